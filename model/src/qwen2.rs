//! TODO(in progress)
