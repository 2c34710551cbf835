//! What the unit tests share.

use proptest::test_runner::{Config, RngAlgorithm};

/// proptest's configuration with `cases` cases (`PROPTEST_CASES` overrides it, for a longer
/// hunt), drawn from XorShift unless `PROPTEST_RNG_ALGORITHM` names another generator. proptest's default, ChaCha, runs at
/// `opt-level = 0` in a test build, where it took two thirds of the protocol fuzzer's time and
/// a third of the region property test's; the tests need varied inputs, not a cryptographic
/// stream. Failures replay from the seeds they print whatever this says.
pub(crate) fn proptest_config(cases: u32) -> Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(cases);
    let mut config = Config::with_cases(cases);
    if std::env::var_os("PROPTEST_RNG_ALGORITHM").is_none() {
        config.rng_algorithm = RngAlgorithm::XorShift;
    }
    config
}
