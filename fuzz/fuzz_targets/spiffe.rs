#![no_main]
//! Harness and invariants: `meshca::fuzzing::spiffe`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = meshca::fuzzing::spiffe(data);
});
