#![no_main]
//! Harness and invariants: `meshca::fuzzing::token_expiry`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = meshca::fuzzing::token_expiry(data);
});
