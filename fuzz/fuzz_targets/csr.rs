#![no_main]
//! Harness and invariants: `meshca::fuzzing::csr`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = meshca::fuzzing::csr(data);
});
