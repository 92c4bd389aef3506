//! Generated `istio.v1.auth` messages and service (from proto/).
#![allow(missing_docs, clippy::all, unreachable_pub)]

tonic::include_proto!("istio.v1.auth");
