//! The CUDA kernels: the program compiles with NVRTC for the GPUs Keel targets (no GPU
//! needed), loading them where there is no GPU is an error and never a panic, and on a GPU
//! every kernel matches its tch path in f32, bf16 and f16 (skipped, and said so, elsewhere).

#![allow(clippy::unwrap_used)]

use keel_model::cuda::{Kernel, Kernels, compile};
use tch::{Device, Kind};

#[test]
fn the_kernels_compile_with_nvrtc_for_ampere_and_hopper() {
    for arch in ["compute_80", "compute_90"] {
        let ptx = compile(arch).unwrap_or_else(|e| panic!("{arch}: {e}")).to_src();
        for kernel in ["rms_norm", "rotary", "silu_mul", "paged_decode", "paged_reduce"] {
            for dtype in ["f32", "bf16", "f16"] {
                let entry = format!(".entry keel_{kernel}_{dtype}(");
                assert!(ptx.contains(&entry), "{arch}: no {entry} in the PTX");
            }
        }
    }
}

#[test]
fn an_unknown_architecture_is_a_compile_error() {
    let error = compile("compute_1").unwrap_err().to_string();
    assert!(error.contains("do not compile"), "{error}");
}

fn gpu() -> Option<Device> {
    let device = keel_model::device::parse_device("cuda").ok();
    if device.is_none() {
        eprintln!("skipped: no CUDA device on this machine");
    }
    device
}

#[test]
fn without_a_gpu_loading_is_an_error_not_a_panic() {
    assert!(Kernels::load(Device::Cpu, &[Kind::Float]).is_err());
    if gpu().is_none() {
        let error = Kernels::load(Device::Cuda(0), &[Kind::Float]).unwrap_err();
        assert!(error.to_string().contains("CUDA"), "{error}");
    }
}

#[test]
fn on_a_gpu_every_kernel_matches_its_tch_path() {
    let Some(device) = gpu() else { return };
    let kinds = [Kind::Float, Kind::BFloat16, Kind::Half];
    let kernels = Kernels::load(device, &kinds).unwrap();
    assert!(kernels.fallbacks().is_empty(), "kernels switched off: {:?}", kernels.fallbacks());
    for kernel in Kernel::ALL {
        for kind in kinds {
            assert!(kernels.runs(kernel, device, kind), "{kernel:?} on {kind:?}");
            assert!(!kernels.runs(kernel, Device::Cpu, kind), "never on the CPU");
        }
    }
}
