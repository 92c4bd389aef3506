#![no_main]
//! Harness and invariants: `meshca::fuzzing::bundle`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = meshca::fuzzing::bundle(data);
});
