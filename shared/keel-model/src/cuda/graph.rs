//! CUDA graphs through libtorch's own `at::cuda::CUDAGraph`, which tch does not bind. The
//! C++ shim (`graph.cpp`, built by build.rs against the torch in `.venv`) is embedded in the
//! binary, written to the temporary directory and loaded the first time a graph or the
//! current stream is asked for — only on CUDA, after `libtorch_cuda.so` is loaded — so a
//! CPU run never touches it. A capture runs on a side stream libtorch makes current and
//! draws memory from a private pool that the graphs of one model share; a replay reruns the
//! captured kernels on the same addresses, so inputs are copied into fixed buffers first and
//! weights are updated in place.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::hash::{Hash, Hasher};
use std::ptr::NonNull;
use std::sync::OnceLock;

use tch::Device;

use keel_collective::LibraryUnavailable;

use super::KernelError;

/// The shim library, or an empty slice where build.rs could not build it.
static LIBRARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libkeel_cuda_graph.so"));
/// What build.rs said: `built`, or why not.
const BUILD_STATUS: &str = env!("KEEL_CUDA_GRAPH_SHIM");

type Result<T, E = KernelError> = std::result::Result<T, E>;

/// The shim's entry points.
struct Shim {
    last_error: unsafe extern "C" fn() -> *const c_char,
    new: unsafe extern "C" fn() -> *mut c_void,
    free: unsafe extern "C" fn(*mut c_void),
    pool: unsafe extern "C" fn(*mut u64, *mut u64) -> c_int,
    begin: unsafe extern "C" fn(*mut c_void, c_int, u64, u64) -> c_int,
    end: unsafe extern "C" fn(*mut c_void) -> c_int,
    replay: unsafe extern "C" fn(*mut c_void) -> c_int,
    current_stream: unsafe extern "C" fn(c_int) -> *mut c_void,
    empty_cache: unsafe extern "C" fn() -> c_int,
}

static SHIM: OnceLock<Result<Shim, LibraryUnavailable>> = OnceLock::new();

/// Loads the shim once; later calls return the same outcome.
fn shim() -> Result<&'static Shim> {
    SHIM.get_or_init(load).as_ref().map_err(|e| KernelError::Unavailable(format!("CUDA graphs: {e}")))
}

fn load() -> Result<Shim, LibraryUnavailable> {
    let unavailable = LibraryUnavailable;
    if LIBRARY.is_empty() {
        return Err(unavailable(format!("the shim was {BUILD_STATUS}")));
    }
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    LIBRARY.hash(&mut hasher);
    let path = std::env::temp_dir().join(format!("keel-cuda-graph-{:016x}.so", hasher.finish()));
    if std::fs::metadata(&path).map(|m| m.len()).ok() != Some(LIBRARY.len() as u64) {
        let partial = path.with_extension(format!("{}.part", std::process::id()));
        std::fs::write(&partial, LIBRARY).map_err(|e| unavailable(format!("writing {}: {e}", partial.display())))?;
        std::fs::rename(&partial, &path).map_err(|e| unavailable(format!("renaming to {}: {e}", path.display())))?;
    }
    let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL;
    // SAFETY: the shim's initialisers are libtorch's; it is loaded once and never unloaded
    // (the handle is leaked below), so the function pointers taken from it stay valid.
    #[allow(unsafe_code)]
    unsafe {
        let library = libloading::os::unix::Library::open(Some(&path), flags)
            .map_err(|e| unavailable(format!("loading {}: {e}", path.display())))?;
        macro_rules! symbol {
            ($name:literal) => {
                *library.get($name).map_err(|e| unavailable(format!("{}: {e}", String::from_utf8_lossy($name))))?
            };
        }
        let shim = Shim {
            last_error: symbol!(b"keel_graph_last_error\0"),
            new: symbol!(b"keel_graph_new\0"),
            free: symbol!(b"keel_graph_free\0"),
            pool: symbol!(b"keel_graph_pool\0"),
            begin: symbol!(b"keel_graph_begin\0"),
            end: symbol!(b"keel_graph_end\0"),
            replay: symbol!(b"keel_graph_replay\0"),
            current_stream: symbol!(b"keel_graph_current_stream\0"),
            empty_cache: symbol!(b"keel_cuda_empty_cache\0"),
        };
        std::mem::forget(library);
        Ok(shim)
    }
}

/// Whether graphs can be made here: the shim was built and loads.
pub fn available() -> Result<()> {
    shim().map(|_| ())
}

impl Shim {
    /// 0 is success; otherwise the shim's message for this thread's last failure.
    fn check(&self, status: c_int, what: &str) -> Result<()> {
        if status == 0 { Ok(()) } else { Err(self.failure(what)) }
    }

    fn failure(&self, what: &str) -> KernelError {
        // SAFETY: the shim returns a NUL-terminated string it owns, valid until this thread's
        // next failing call.
        #[allow(unsafe_code)]
        let message = unsafe { CStr::from_ptr((self.last_error)()) }.to_string_lossy().into_owned();
        // libtorch's messages carry a C++ backtrace after the first line.
        let first = message.lines().next().unwrap_or("");
        KernelError::Driver(format!("CUDA graph {what}: {first}"))
    }
}

fn ordinal(device: Device) -> Result<c_int> {
    match device {
        Device::Cuda(n) => Ok(n as c_int),
        other => Err(KernelError::Unavailable(format!("CUDA graphs need a CUDA device, not {other:?}"))),
    }
}

/// libtorch's current stream on `ordinal` when the shim is already loaded (the capture
/// stream during a capture); `None` before, when the legacy default stream is current.
pub(crate) fn current_stream(ordinal: usize) -> Option<*mut c_void> {
    let shim = SHIM.get()?.as_ref().ok()?;
    // SAFETY: takes a device index and returns a stream handle or null.
    #[allow(unsafe_code)]
    let stream = unsafe { (shim.current_stream)(ordinal as c_int) };
    (!stream.is_null()).then_some(stream)
}

/// Hands the GPU memory libtorch's caching allocator keeps for reuse back to the driver
/// (`torch.cuda.empty_cache()`), so that another process on the same GPU can have it.
pub fn empty_cache() -> Result<()> {
    let shim = shim()?;
    // SAFETY: takes nothing; failures are reported through the status.
    #[allow(unsafe_code)]
    let status = unsafe { (shim.empty_cache)() };
    shim.check(status, "empty_cache")
}

/// A memory pool the graphs of one model share (they never replay at the same time).
#[derive(Debug, Clone, Copy)]
pub struct GraphPool(u64, u64);

impl GraphPool {
    pub fn new() -> Result<Self> {
        let shim = shim()?;
        let (mut first, mut second) = (0, 0);
        // SAFETY: writes two integers.
        #[allow(unsafe_code)]
        let status = unsafe { (shim.pool)(&mut first, &mut second) };
        shim.check(status, "pool")?;
        Ok(Self(first, second))
    }
}

/// A captured CUDA graph.
#[derive(Debug)]
pub struct CudaGraph {
    raw: NonNull<c_void>,
}

// SAFETY: the graph is only replayed and freed through `&self`/`Drop`; libtorch's CUDAGraph
// may be used from any thread, one call at a time, which `&mut`-free replay from a single
// owner (the engine thread) gives.
#[allow(unsafe_code)]
unsafe impl Send for CudaGraph {}

impl CudaGraph {
    /// Captures what `work` launches on `device` into a new graph drawing its memory from
    /// `pool`, and returns it with `work`'s result (tensors that live in the pool: the
    /// graph's outputs on every replay). The capture is ended even when `work` fails.
    pub fn capture<T>(
        device: Device,
        pool: &GraphPool,
        work: impl FnOnce() -> crate::Result<T>,
    ) -> crate::Result<(CudaGraph, T)> {
        let shim = shim()?;
        let ordinal = ordinal(device)?;
        // SAFETY: allocates a graph object, or returns null.
        #[allow(unsafe_code)]
        let raw = NonNull::new(unsafe { (shim.new)() }).ok_or_else(|| shim.failure("create"))?;
        let graph = CudaGraph { raw };
        // SAFETY: `raw` is a live graph; begin and end pair up below on every path.
        #[allow(unsafe_code)]
        shim.check(unsafe { (shim.begin)(raw.as_ptr(), ordinal, pool.0, pool.1) }, "capture")?;
        let outcome = work();
        #[allow(unsafe_code)]
        let ended = shim.check(unsafe { (shim.end)(raw.as_ptr()) }, "capture end");
        let value = outcome?;
        ended?;
        Ok((graph, value))
    }

    /// Reruns the captured work on the current stream.
    pub fn replay(&self) -> Result<()> {
        let shim = shim()?;
        // SAFETY: `raw` is a live, captured graph.
        #[allow(unsafe_code)]
        let status = unsafe { (shim.replay)(self.raw.as_ptr()) };
        shim.check(status, "replay")
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        if let Ok(shim) = shim() {
            // SAFETY: `raw` was made by the shim and is freed once.
            #[allow(unsafe_code)]
            unsafe {
                (shim.free)(self.raw.as_ptr())
            };
        }
    }
}
