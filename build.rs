//! Builds lipsync's own kernels (src/model/kernels): the host C++ version for every build
//! (the CPU tests check its arithmetic against candle's operations), and with the `cuda`
//! feature the PTX the GPU runs, by nvcc as candle's kernels are (`NVCC`, else
//! `$CUDA_ROOT/bin/nvcc`, else `nvcc` on the PATH; architecture from `CUDA_COMPUTE_CAP`,
//! default 90).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let dir = PathBuf::from("src/model/kernels");
    for f in ["lipsync_kernels.h", "kernels.cu", "host.cpp"] {
        println!("cargo:rerun-if-changed={}", dir.join(f).display());
    }
    for v in ["NVCC", "CUDA_ROOT", "CUDA_COMPUTE_CAP"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    cc::Build::new()
        .cpp(true)
        .file(dir.join("host.cpp"))
        .flag_if_supported("-std=c++14")
        .warnings(true)
        .compile("lipsync_kernels_host");

    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("CUDA_ROOT")
                .map(|r| PathBuf::from(r).join("bin/nvcc"))
                .filter(|p| p.exists())
        })
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let cap: String = cap.chars().filter(|c| c.is_ascii_digit()).collect();
    let ptx = out.join("lipsync_kernels.ptx");
    let status = Command::new(&nvcc)
        .arg("--ptx")
        .arg(format!("-arch=compute_{cap}"))
        .args(["-O3", "-std=c++17", "-lineinfo"])
        .arg(dir.join("kernels.cu"))
        .arg("-o")
        .arg(&ptx)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {} to build the kernels: {e}", nvcc.display()));
    assert!(
        status.success(),
        "{} failed to compile src/model/kernels/kernels.cu ({status})",
        nvcc.display()
    );
}
