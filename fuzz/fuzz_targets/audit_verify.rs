#![no_main]
//! Harness and invariants: `meshca::fuzzing::audit_verify`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = meshca::fuzzing::audit_verify(data);
});
