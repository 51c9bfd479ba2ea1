//! tandem-router (in progress)
