//! Compiles `tandem/verifier/v1/verifier.proto` with `protox` (a pure-Rust protobuf
//! compiler, so no system `protoc` is needed) and generates tonic/prost code from the
//! resulting descriptor set. The encoded descriptor set is also written to OUT_DIR
//! for gRPC server reflection.

use prost::Message;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "tandem/verifier/v1/verifier.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["."])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("tandem_verifier_v1_descriptor.bin"),
        fds.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
