#![no_main]
//! Harness and invariants: `meshca::fuzzing::token_review`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = meshca::fuzzing::token_review(data);
});
