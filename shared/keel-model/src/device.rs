//! Choosing the torch device: `cpu`, `cuda` or `cuda:N`. CUDA support lives in
//! `libtorch_cuda.so`, which the linker drops as unneeded; it is loaded here before CUDA is
//! probed, and a machine without it gets a clear error instead of a panic.

use std::sync::OnceLock;

use keel_collective::LibraryUnavailable;
use tch::{Device, Kind};

use crate::error::{Error, Result};

fn load_torch_cuda() -> Result<(), LibraryUnavailable> {
    static LOADED: OnceLock<Result<(), LibraryUnavailable>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            // SAFETY: loading libtorch's own CUDA library runs its static initialisers, which
            // register the CUDA backend with the already-loaded libtorch; the handle is leaked
            // so the library stays loaded for the life of the process.
            #[allow(unsafe_code)]
            let library = unsafe { libloading::os::unix::Library::open(Some("libtorch_cuda.so"), libc_flags()) };
            library.map(std::mem::forget).map_err(|e| LibraryUnavailable(e.to_string()))
        })
        .clone()
}

fn libc_flags() -> i32 {
    libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL
}

/// Parses a device name and checks that the device is usable.
pub fn parse_device(name: &str) -> Result<Device> {
    let ordinal = match name {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => 0,
        other => other
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| Error::Device(format!("unknown device `{other}` (use cpu, cuda or cuda:N)")))?,
    };
    load_torch_cuda()
        .map_err(|e| Error::Device(format!("CUDA requested but libtorch_cuda.so could not be loaded: {e}")))?;
    let count = tch::Cuda::device_count() as usize;
    if ordinal >= count {
        return Err(Error::Device(format!("CUDA device {ordinal} requested, {count} available")));
    }
    Ok(Device::Cuda(ordinal))
}

/// `cuda` for a GPU, else `cpu`: the kind of memory a tensor is in, as the weight transfers
/// name it on the wire.
pub fn memory_name(device: Device) -> &'static str {
    if device.is_cuda() { "cuda" } else { "cpu" }
}

/// Parses a parameter dtype name: f32, bf16 or f16.
pub fn parse_kind(name: &str) -> Result<Kind> {
    match name {
        "f32" | "float32" => Ok(Kind::Float),
        "bf16" | "bfloat16" => Ok(Kind::BFloat16),
        "f16" | "float16" => Ok(Kind::Half),
        other => Err(Error::InvalidInput(format!("unknown dtype `{other}` (use f32, bf16 or f16)"))),
    }
}

/// After memory on `device` was freed for another process on the same GPU (a colocated
/// turn): libtorch's cached blocks go back to the driver. Nothing to do on the CPU.
pub fn return_cached_memory(device: Device) -> Result<()> {
    if device.is_cuda() {
        crate::cuda::graph::empty_cache().map_err(|e| Error::Device(e.to_string()))?;
    }
    Ok(())
}

/// Moves `tensors` (parameters, optimiser state) to `device` in place: each keeps its
/// identity, so every handle to it (a layer's, the optimiser's) sees the move, and its
/// storage on the old device is freed once nothing else holds it. For a colocated trainer
/// or generator handing the GPU to the other. Returns the bytes moved (tensors already on
/// `device` move none).
pub fn move_in_place<'a>(tensors: impl IntoIterator<Item = &'a tch::Tensor>, device: Device) -> Result<u64> {
    let _no_grad = tch::no_grad_guard();
    let mut bytes = 0;
    for tensor in tensors {
        if tensor.device() == device {
            continue;
        }
        let moved = tensor.f_to_device(device)?;
        tensor.shallow_clone().f_set_data(&moved)?;
        bytes += (tensor.numel() * tensor.kind().elt_size_in_bytes()) as u64;
    }
    Ok(bytes)
}
