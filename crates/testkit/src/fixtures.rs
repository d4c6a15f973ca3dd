//! Events that the tests and benches of several crates build alike: kedge-core's own fixtures
//! (feature `test-util`), re-exported here beside the rest of the test kit.

pub use kedge_core::fixtures::run_created;
