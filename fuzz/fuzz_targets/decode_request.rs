#![no_main]
//! Harness and invariants: `meshca::fuzzing::decode_request`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = meshca::fuzzing::decode_request(data);
});
