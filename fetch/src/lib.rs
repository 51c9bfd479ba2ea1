//! tandem-fetch (in progress)
