//! tandem-shard (in progress)
