//! Builds the CUDA graph shim (`src/cuda/graph.cpp`) into a shared library in OUT_DIR, which
//! `cuda::graph` embeds. It needs libtorch's CUDA headers and `libtorch_cuda` (torch's CUDA
//! wheels, as `.venv` has) and a C++ compiler; where any is missing, an empty file is
//! embedded instead and graphs report why at run time. Nothing here makes the CPU build
//! depend on CUDA.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/cuda/graph.cpp");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let library = out.join("libkeel_cuda_graph.so");
    let status = match build(&library) {
        Ok(()) => "built".to_string(),
        Err(why) => {
            std::fs::write(&library, b"").expect("write an empty shim");
            format!("not built: {why}")
        }
    };
    println!("cargo:rustc-env=KEEL_CUDA_GRAPH_SHIM={status}");
}

fn build(library: &Path) -> Result<(), String> {
    let lib = PathBuf::from(std::env::var("DEP_TCH_LIBTORCH_LIB").map_err(|_| "torch-sys gave no libtorch path")?);
    let torch = lib.parent().ok_or("libtorch's lib directory has no parent")?;
    let cuda_include = torch.join("../nvidia/cu13/include");
    let needed = [
        torch.join("include/ATen/cuda/CUDAGraph.h"),
        cuda_include.join("cuda_runtime_api.h"),
        lib.join("libtorch_cuda.so"),
        lib.join("libc10_cuda.so"),
    ];
    if let Some(missing) = needed.iter().find(|p| !p.exists()) {
        return Err(format!("{} is missing (a CPU-only torch?)", missing.display()));
    }
    let compiler = cc::Build::new().cpp(true).get_compiler();
    let output = Command::new(compiler.path())
        .args(["-shared", "-fPIC", "-O2", "-std=c++17", "-D_GLIBCXX_USE_CXX11_ABI=1", "-DGLOG_USE_GLOG_EXPORT", "-w"])
        .arg(format!("-I{}", torch.join("include").display()))
        .arg(format!("-I{}", torch.join("include/torch/csrc/api/include").display()))
        .arg(format!("-I{}", cuda_include.display()))
        .arg("src/cuda/graph.cpp")
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-Wl,--no-as-needed", "-ltorch_cuda", "-lc10_cuda", "-ltorch_cpu", "-lc10"])
        .arg("-o")
        .arg(library)
        .output()
        .map_err(|e| format!("running {}: {e}", compiler.path().display()))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(format!("the C++ compiler failed: {}", stderr.lines().take(20).collect::<Vec<_>>().join(" | ")));
    }
    Ok(())
}
