//! Weights shared between processes on one host's GPUs through CUDA IPC, the transport of a
//! colocated refit: the trainer packs its export into one buffer in its GPU's memory and
//! publishes, per bucket, the IPC handle of the allocation it lies in (`cuIpcGetMemHandle`)
//! with its offset and the GPU's UUID; a generator on the same host opens the handle
//! (`cuIpcOpenMemHandle`), copies each bucket into memory of its own on that GPU, and closes
//! it again. Nothing goes through host memory.
//!
//! CUDA maps an allocation at most once per process and never in the process that made it,
//! so handles are opened once per distinct allocation, and a bucket exported by this very
//! process is read at its address instead.

use std::collections::HashMap;

use cudarc::driver::{CudaContext, result, sys};
use keel_protocol::generator::CudaIpcBuffer;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

fn driver(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Device(format!("CUDA IPC, {what}: {e}"))
}

/// The driver, or a clear error where there is none.
fn driver_present() -> Result<()> {
    // SAFETY: only probes whether libcuda can be loaded.
    #[allow(unsafe_code)]
    let present = unsafe { sys::is_culib_present() };
    if present { Ok(()) } else { Err(Error::Device("CUDA IPC needs the CUDA driver (libcuda.so), not found".into())) }
}

/// Driver bytes (`c_char`) as lowercase hex.
fn hex(bytes: &[std::ffi::c_char]) -> String {
    bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect()
}

/// The UUID of CUDA device `ordinal` of this process, as hex.
pub fn device_uuid(ordinal: usize) -> Result<String> {
    driver_present()?;
    result::init().map_err(driver("initialising the driver"))?;
    let device = result::device::get(ordinal as i32).map_err(driver("finding the device"))?;
    Ok(hex(&result::device::get_uuid(device).map_err(driver("reading the device's UUID"))?.bytes))
}

/// The ordinal, in this process, of the GPU whose UUID is `uuid`.
fn ordinal_of(uuid: &str) -> Result<usize> {
    driver_present()?;
    result::init().map_err(driver("initialising the driver"))?;
    let count = result::device::get_count().map_err(driver("counting devices"))?;
    for ordinal in 0..count.max(0) as usize {
        if device_uuid(ordinal)? == uuid {
            return Ok(ordinal);
        }
    }
    Err(Error::Device(format!(
        "the weights are in the memory of GPU {uuid}, which this process cannot see (it sees {count}): \
         CUDA IPC works between processes on one host; use another weight transfer"
    )))
}

/// Buckets starting at `offsets` in `buffer`, a flat byte tensor on a CUDA device, described
/// for another process: the handle of the allocation `buffer` lies in and each bucket's
/// offset in it. `buffer` must outlive every reader's copy.
pub fn share(buffer: &Tensor, offsets: &[u64]) -> Result<Vec<CudaIpcBuffer>> {
    let Device::Cuda(ordinal) = buffer.device() else {
        return Err(Error::Device(format!("CUDA IPC shares GPU memory; the export is on {:?}", buffer.device())));
    };
    driver_present()?;
    // Retains the device's primary context (libtorch's) and makes it current on this thread.
    let context = CudaContext::new(ordinal).map_err(driver("binding the device"))?;
    let address = buffer.data_ptr() as sys::CUdeviceptr;
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: `address` is the data of a live CUDA tensor of this context's device; both
    // calls only write the out-parameters given.
    #[allow(unsafe_code)]
    unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, address)
            .result()
            .map_err(driver("finding the allocation"))?;
        sys::cuIpcGetMemHandle(&mut handle, base).result().map_err(driver("making a handle"))?;
    }
    let handle_hex = hex(&handle.reserved);
    let device_uuid = hex(&context.uuid().map_err(driver("reading the device's UUID"))?.bytes);
    let start = address - base;
    Ok(offsets
        .iter()
        .map(|&offset| CudaIpcBuffer {
            handle: handle_hex.clone(),
            offset: start + offset,
            device_uuid: device_uuid.clone(),
            pid: std::process::id(),
            address: address + offset,
        })
        .collect())
}

fn parse_handle(hex: &str) -> Result<sys::CUipcMemHandle> {
    let bytes: Option<Vec<u8>> = (0..hex.len())
        .step_by(2)
        .map(|i| hex.get(i..i + 2).and_then(|pair| u8::from_str_radix(pair, 16).ok()))
        .collect();
    let Some(bytes) = bytes.filter(|b| b.len() == 64) else {
        return Err(Error::InvalidInput(format!("a CUDA IPC handle is 64 bytes in hex, not `{hex}`")));
    };
    let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
    for (slot, byte) in handle.reserved.iter_mut().zip(bytes) {
        *slot = byte as std::ffi::c_char;
    }
    Ok(handle)
}

/// An allocation of another process mapped into this one; unmapped when dropped.
struct Mapped(sys::CUdeviceptr);

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the pointer came from cuIpcOpenMemHandle and every tensor viewing it has
        // been dropped (the copies were synchronised first).
        #[allow(unsafe_code)]
        unsafe {
            let _ = sys::cuIpcCloseMemHandle(self.0);
        }
    }
}

/// Copies of the buckets `buckets` (each with its size in bytes) names, flat byte tensors on
/// the GPU they are in, in order: each handle opened once, every copy finished before the
/// handles are closed again.
pub fn fetch(buckets: &[(&CudaIpcBuffer, u64)]) -> Result<Vec<Tensor>> {
    let Some((first, _)) = buckets.first() else { return Ok(Vec::new()) };
    if let Some((other, _)) = buckets.iter().find(|(b, _)| b.device_uuid != first.device_uuid) {
        return Err(Error::InvalidInput(format!(
            "one export's buckets are on two GPUs ({} and {})",
            first.device_uuid, other.device_uuid
        )));
    }
    let ordinal = ordinal_of(&first.device_uuid)?;
    crate::device::parse_device(&format!("cuda:{ordinal}"))?;
    // Retains the device's primary context (libtorch's) and makes it current on this thread.
    let _context = CudaContext::new(ordinal).map_err(driver("binding the device"))?;
    let own = std::process::id();
    let mut mapped: HashMap<&str, Mapped> = HashMap::new();
    let mut copies = Vec::with_capacity(buckets.len());
    for (bucket, bytes) in buckets {
        let address = if bucket.pid == own {
            bucket.address
        } else {
            if !mapped.contains_key(bucket.handle.as_str()) {
                let handle = parse_handle(&bucket.handle)?;
                let mut pointer: sys::CUdeviceptr = 0;
                // SAFETY: writes only the out-parameter; the handle is checked by the driver.
                #[allow(unsafe_code)]
                unsafe {
                    sys::cuIpcOpenMemHandle_v2(
                        &mut pointer,
                        handle,
                        sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                    )
                    .result()
                    .map_err(driver("opening the trainer's buffer (has its process ended?)"))?;
                }
                mapped.insert(bucket.handle.as_str(), Mapped(pointer));
            }
            mapped[bucket.handle.as_str()].0 + bucket.offset
        };
        // SAFETY: the memory is `bytes` long from `address` on this device (the exporter's
        // allocation, mapped above and kept until after the synchronisation below); the view
        // is dropped as soon as it is copied.
        #[allow(unsafe_code)]
        let view = unsafe {
            Tensor::f_from_blob(address as *const u8, &[*bytes as i64], &[1], Kind::Uint8, Device::Cuda(ordinal))?
        };
        copies.push(view.f_detach_copy()?);
    }
    tch::Cuda::synchronize(ordinal as i64);
    drop(mapped);
    Ok(copies)
}
