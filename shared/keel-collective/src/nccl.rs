//! The NCCL backend: one communicator per GPU, operating in place on CUDA tensors on the
//! device's legacy default stream (the one libtorch's kernels run on), so collectives are
//! ordered with the surrounding tensor work without extra synchronisation.
//!
//! Two ways to build a group:
//! - [`NcclGroup::new`]: every GPU in this process (`ncclCommInitAll`), one rank per thread;
//! - [`NcclCollective::join`]: one rank of a group spread over processes or machines. Rank 0
//!   makes a [`UniqueId`]; the others receive it ([`crate::bootstrap`] carries it over
//!   NATS) and every rank joins with it.
//!
//! Both libraries are loaded when first needed, never linked: the CUDA driver through
//! cudarc (dynamic loading) and NCCL with libloading, by the names NVIDIA's packages and
//! libtorch's wheel install (`libnccl.so.2`; cudarc 0.19's loader looks only for
//! `libnccl.so` and CUDA-versioned names). A machine without either gets an error naming
//! what is missing, never a panic.

// NCCL is a C library: the calls below pass raw device pointers and handles. Each unsafe
// block states what it relies on.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock};

use tch::{Device, Kind, Tensor};

use crate::{Collective, Error, LibraryUnavailable, ReduceOp, Result};

/// The 128-byte id every rank of a multi-process group joins with.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    internal: [c_char; 128],
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UniqueId(..)")
    }
}

impl UniqueId {
    /// A new id (rank 0 makes it and shares it).
    pub fn new() -> Result<Self> {
        let api = api()?;
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: ncclGetUniqueId writes one ncclUniqueId (128 bytes, this layout) to `id`.
        check(api, unsafe { (api.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
        Ok(id)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.internal.iter().map(|&c| c as u8).collect()
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != 128 {
            return Err(Error::Invalid(format!("an NCCL unique id has 128 bytes, got {}", bytes.len())));
        }
        let mut id = UniqueId { internal: [0; 128] };
        for (to, &from) in id.internal.iter_mut().zip(bytes) {
            *to = from as c_char;
        }
        Ok(id)
    }
}

type Comm = *mut c_void;
type Stream = *mut c_void;
type Status = c_int;

/// The NCCL functions Keel calls.
struct Api {
    _library: libloading::Library,
    get_version: unsafe extern "C" fn(*mut c_int) -> Status,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Status,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> Status,
    comm_init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> Status,
    comm_destroy: unsafe extern "C" fn(Comm) -> Status,
    comm_abort: unsafe extern "C" fn(Comm) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> Status,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> Status,
    reduce_scatter: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> Status,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> Status,
}

const LIBRARY_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// The function `name` of `library`, as the type the caller names.
///
/// # Safety
/// `T` must be the C signature of the exported function.
unsafe fn symbol<T: Copy>(library: &libloading::Library, name: &str) -> std::result::Result<T, LibraryUnavailable> {
    // SAFETY: the caller names the function's true signature.
    unsafe { library.get::<T>(name.as_bytes()).map(|s| *s).map_err(|e| LibraryUnavailable(format!("{name}: {e}"))) }
}

fn load() -> std::result::Result<Api, LibraryUnavailable> {
    let mut tried = Vec::new();
    for name in LIBRARY_NAMES {
        // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
        match unsafe { libloading::Library::new(name) } {
            // SAFETY: each symbol is NCCL's public C function with the signature declared in
            // `Api` (nccl.h, NCCL 2.x); the library stays loaded inside `Api`.
            Ok(library) => unsafe {
                return Ok(Api {
                    get_version: symbol(&library, "ncclGetVersion")?,
                    get_unique_id: symbol(&library, "ncclGetUniqueId")?,
                    comm_init_rank: symbol(&library, "ncclCommInitRank")?,
                    comm_init_all: symbol(&library, "ncclCommInitAll")?,
                    comm_destroy: symbol(&library, "ncclCommDestroy")?,
                    comm_abort: symbol(&library, "ncclCommAbort")?,
                    error_string: symbol(&library, "ncclGetErrorString")?,
                    all_reduce: symbol(&library, "ncclAllReduce")?,
                    all_gather: symbol(&library, "ncclAllGather")?,
                    reduce_scatter: symbol(&library, "ncclReduceScatter")?,
                    broadcast: symbol(&library, "ncclBroadcast")?,
                    _library: library,
                });
            },
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    Err(LibraryUnavailable(format!(
        "NCCL is not available ({}); install NVIDIA's NCCL or put torch's nvidia/nccl/lib on LD_LIBRARY_PATH",
        tried.join("; ")
    )))
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, LibraryUnavailable>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(|e| Error::Invalid(e.to_string()))
}

fn check(api: &Api, status: Status, call: &str) -> Result<()> {
    if status == 0 {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
    let text = unsafe { CStr::from_ptr((api.error_string)(status)) }.to_string_lossy().into_owned();
    Err(Error::Invalid(format!("{call} failed: {text} (NCCL error {status})")))
}

/// The version of the NCCL library found (e.g. 22809 for 2.28.9).
pub fn version() -> Result<i32> {
    let api = api()?;
    let mut version = 0;
    // SAFETY: ncclGetVersion writes one int.
    check(api, unsafe { (api.get_version)(&mut version) }, "ncclGetVersion")?;
    Ok(version)
}

/// The CUDA context of GPU `ordinal`, made current on the calling thread (NCCL and the
/// default stream refer to the current device).
fn bind(ordinal: usize) -> Result<Arc<cudarc::driver::CudaContext>> {
    // SAFETY: only probes whether libcuda can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::Invalid("the CUDA driver (libcuda.so) is not available on this machine".into()));
    }
    let context =
        cudarc::driver::CudaContext::new(ordinal).map_err(|e| Error::Invalid(format!("CUDA device {ordinal}: {e}")))?;
    context.bind_to_thread().map_err(|e| Error::Invalid(format!("CUDA device {ordinal}: {e}")))?;
    Ok(context)
}

/// Free and total bytes of GPU `ordinal`, as the driver sees them (every process's use
/// counted): what a generator sizes its KV cache from.
pub fn device_memory(ordinal: usize) -> Result<(usize, usize)> {
    bind(ordinal)?.mem_get_info().map_err(|e| Error::Invalid(format!("CUDA device {ordinal}: {e}")))
}

fn data_type(kind: Kind) -> Result<c_int> {
    Ok(match kind {
        Kind::Int8 => 0,
        Kind::Uint8 | Kind::Bool => 1,
        Kind::Int => 2,
        Kind::Int64 => 4,
        Kind::Half => 6,
        Kind::Float => 7,
        Kind::Double => 8,
        Kind::BFloat16 => 9,
        other => return Err(Error::Invalid(format!("NCCL cannot reduce {other:?} tensors"))),
    })
}

fn reduce_op(op: ReduceOp) -> c_int {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 2,
    }
}

/// Makes the communicators of every GPU of one process.
#[derive(Debug)]
pub struct NcclGroup;

impl NcclGroup {
    /// One communicator per GPU ordinal in `devices` (rank r on `devices[r]`), to be moved
    /// to one thread each.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(devices: &[usize]) -> Result<Vec<NcclCollective>> {
        if devices.is_empty() {
            return Err(Error::Invalid("a group needs at least one rank".into()));
        }
        let contexts = devices.iter().map(|&d| bind(d)).collect::<Result<Vec<_>>>()?;
        let api = api()?;
        let mut comms: Vec<Comm> = vec![std::ptr::null_mut(); devices.len()];
        let list: Vec<c_int> = devices.iter().map(|&d| d as c_int).collect();
        // SAFETY: `comms` has room for one handle per device in `list`.
        let status = unsafe { (api.comm_init_all)(comms.as_mut_ptr(), list.len() as c_int, list.as_ptr()) };
        check(api, status, "ncclCommInitAll")?;
        Ok(comms
            .into_iter()
            .zip(contexts)
            .enumerate()
            .map(|(rank, (comm, context))| NcclCollective {
                rank,
                world_size: devices.len(),
                ordinal: devices[rank],
                state: Arc::new(Mutex::new(CommState::Live(LiveComm(comm)))),
                context,
                watchdog: None,
            })
            .collect())
    }
}

/// A communicator handle that may cross threads: the watchdog aborts it from its own.
#[derive(Clone, Copy)]
struct LiveComm(Comm);

// SAFETY: NCCL handles are plain pointers into NCCL's own state; ncclCommAbort is meant to be
// called from a thread other than the one blocked in the communicator's operations.
unsafe impl Send for LiveComm {}

/// A communicator in use, or aborted (and freed by NCCL) with the reason.
enum CommState {
    Live(LiveComm),
    Aborted(String),
}

/// One rank's NCCL communicator.
pub struct NcclCollective {
    rank: usize,
    world_size: usize,
    ordinal: usize,
    state: Arc<Mutex<CommState>>,
    context: Arc<cudarc::driver::CudaContext>,
    /// What aborts the communicator when a peer process is lost (multi-process groups).
    watchdog: Option<crate::watchdog::Watchdog>,
}

impl std::fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCollective")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.ordinal)
            .field("watched", &self.watchdog.is_some())
            .finish()
    }
}

// SAFETY: an NCCL communicator may be used from any thread, one operation at a time; every
// operation here takes it through `&self` from the one thread that owns the rank (the
// trait's contract: one caller per rank, operations in order).
unsafe impl Send for NcclCollective {}
// SAFETY: as above; sharing is between a rank's models on that rank's thread.
unsafe impl Sync for NcclCollective {}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let (CommState::Live(comm), Ok(api)) = (&*state, api()) {
            // SAFETY: the handle came from NCCL and is live (not aborted); it is destroyed
            // once, under the lock the watchdog's abort takes.
            unsafe { (api.comm_destroy)(comm.0) };
        }
        *state = CommState::Aborted("the communicator was dropped".into());
    }
}

/// Aborts the communicator it was made from, once, from any thread: what a
/// [`crate::watchdog::Watchdog`] calls when a peer is lost.
#[derive(Clone)]
pub struct AbortHandle {
    state: Arc<Mutex<CommState>>,
}

impl std::fmt::Debug for AbortHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AbortHandle(..)")
    }
}

impl AbortHandle {
    /// `ncclCommAbort`: the kernels of this rank's pending operations end (their results are
    /// garbage) so its stream moves on, and every later operation on the communicator is an
    /// [`Error::Aborted`] naming `reason`. Nothing happens when it was aborted or dropped
    /// already.
    pub fn abort(&self, reason: &str) {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let (CommState::Live(comm), Ok(api)) = (&*state, api()) {
            // SAFETY: the handle is live; NCCL frees it here, and the state below keeps
            // every later operation (and the drop) from touching it again.
            unsafe { (api.comm_abort)(comm.0) };
            tracing::warn!("NCCL communicator aborted: {reason}");
        }
        *state = CommState::Aborted(reason.to_string());
    }
}

impl NcclCollective {
    /// Joins rank `rank` of a `world_size`-rank group with the id rank 0 made, on GPU
    /// `ordinal`. Every rank must call it; it returns once all have.
    pub fn join(id: UniqueId, rank: usize, world_size: usize, ordinal: usize) -> Result<Self> {
        if rank >= world_size {
            return Err(Error::Invalid(format!("rank {rank} of a group of {world_size}")));
        }
        let context = bind(ordinal)?;
        let api = api()?;
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: `comm` receives one handle; the id is passed by value as NCCL expects.
        let status = unsafe { (api.comm_init_rank)(&mut comm, world_size as c_int, id, rank as c_int) };
        check(api, status, "ncclCommInitRank")?;
        let state = Arc::new(Mutex::new(CommState::Live(LiveComm(comm))));
        Ok(Self { rank, world_size, ordinal, state, context, watchdog: None })
    }

    /// Joins a multi-process group: rank 0 makes the unique id and shares it over NATS
    /// on `subject` ([`crate::bootstrap::share_id`]), then every rank joins on GPU `ordinal`.
    pub async fn join_over_nats(
        client: &async_nats::Client,
        subject: &str,
        rank: usize,
        world_size: usize,
        ordinal: usize,
        timeout: std::time::Duration,
    ) -> Result<Self> {
        let make = || UniqueId::new().map(|id| id.to_bytes());
        let bytes = crate::bootstrap::share_id(client, subject, rank, world_size, make, timeout).await?;
        let id = UniqueId::from_bytes(&bytes)?;
        tokio::task::spawn_blocking(move || Self::join(id, rank, world_size, ordinal))
            .await
            .map_err(|e| Error::Invalid(format!("rank {rank}: joining the NCCL group: {e}")))?
    }

    /// Aborts the communicator (this rank's pending operations end instead of hanging; the
    /// others' end when their own watchdogs abort theirs).
    pub fn abort(&self, reason: &str) {
        self.abort_handle().abort(reason);
    }

    /// A handle that aborts this communicator from another thread.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle { state: self.state.clone() }
    }

    /// This communicator, kept with the watchdog that aborts it (stopped when it is dropped).
    pub fn watched_by(mut self, watchdog: crate::watchdog::Watchdog) -> Self {
        self.watchdog = Some(watchdog);
        self
    }

    /// Checks that `tensor` is contiguous on this rank's GPU.
    fn check_tensor(&self, tensor: &Tensor, operation: &str) -> Result<c_int> {
        if tensor.device() != Device::Cuda(self.ordinal) {
            return Err(Error::Mismatch {
                rank: self.rank,
                message: format!("{operation}: tensor on {:?}, this rank is on cuda:{}", tensor.device(), self.ordinal),
            });
        }
        if !tensor.is_contiguous() {
            return Err(Error::Mismatch { rank: self.rank, message: format!("{operation}: tensor is not contiguous") });
        }
        data_type(tensor.kind())
    }

    /// The live communicator, with this rank's GPU made current; an error naming why once
    /// the communicator was aborted.
    fn ready(&self, operation: &'static str) -> Result<(&'static Api, LiveComm)> {
        let comm = match &*self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner) {
            CommState::Live(comm) => *comm,
            CommState::Aborted(reason) => {
                return Err(Error::Aborted { rank: self.rank, operation, reason: reason.clone() });
            }
        };
        self.context.bind_to_thread().map_err(|e| Error::Invalid(format!("cuda:{}: {e}", self.ordinal)))?;
        Ok((api()?, comm))
    }

    fn torch_error(&self, e: tch::TchError) -> Error {
        Error::Mismatch { rank: self.rank, message: e.to_string() }
    }

    /// All-gathers equal-size contiguous `tensor`s into a new [world, ...] tensor.
    fn gather_equal(&self, tensor: &Tensor) -> Result<Tensor> {
        let dtype = self.check_tensor(tensor, "all_gather")?;
        let (api, comm) = self.ready("all_gather")?;
        let mut shape = vec![self.world_size as i64];
        shape.extend(tensor.size());
        let out =
            Tensor::f_empty(shape.as_slice(), (tensor.kind(), tensor.device())).map_err(|e| self.torch_error(e))?;
        // SAFETY: both buffers are contiguous on this rank's GPU; `out` holds world × numel
        // elements of the same dtype; the null stream is the device's default stream.
        let status = unsafe {
            (api.all_gather)(tensor.data_ptr(), out.data_ptr(), tensor.numel(), dtype, comm.0, std::ptr::null_mut())
        };
        check(api, status, "ncclAllGather")?;
        Ok(out)
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        let contiguous = tensor.is_contiguous();
        let buffer =
            if contiguous { tensor.shallow_clone() } else { tensor.f_contiguous().map_err(|e| self.torch_error(e))? };
        let dtype = self.check_tensor(&buffer, "all_reduce")?;
        let (api, comm) = self.ready("all_reduce")?;
        let ptr = buffer.data_ptr();
        // SAFETY: in-place all-reduce of `numel` elements of a contiguous buffer on this GPU.
        let status =
            unsafe { (api.all_reduce)(ptr, ptr, buffer.numel(), dtype, reduce_op(op), comm.0, std::ptr::null_mut()) };
        check(api, status, "ncclAllReduce")?;
        if !contiguous {
            tensor.f_copy_(&buffer).map_err(|e| self.torch_error(e))?;
        }
        Ok(())
    }

    fn all_gather(&self, tensor: &Tensor, dim: i64) -> Result<Tensor> {
        let dims = tensor.dim() as i64;
        if dim < 0 || dim >= dims {
            return Err(Error::Invalid(format!("all_gather along dimension {dim} of a {dims}-d tensor")));
        }
        // NCCL gathers equal sizes: pad along `dim` to the largest rank's size, then cut.
        let size = Tensor::from_slice(&[tensor.size()[dim as usize]])
            .f_to_device(tensor.device())
            .map_err(|e| self.torch_error(e))?;
        let sizes = self
            .gather_equal(&size)?
            .f_flatten(0, -1)
            .and_then(|t| t.f_to_device(Device::Cpu))
            .and_then(Vec::<i64>::try_from)
            .map_err(|e| self.torch_error(e))?;
        let largest = sizes.iter().copied().max().unwrap_or(0);
        let own = tensor.size()[dim as usize];
        let moved = tensor.f_movedim(dim, 0).map_err(|e| self.torch_error(e))?;
        let padded = if own < largest {
            let mut pad = vec![0i64; 2 * (dims as usize)];
            let last = pad.len() - 1;
            pad[last] = largest - own;
            moved.f_constant_pad_nd(pad.as_slice()).map_err(|e| self.torch_error(e))?
        } else {
            moved
        };
        let gathered = self.gather_equal(&padded.f_contiguous().map_err(|e| self.torch_error(e))?)?;
        let parts = sizes
            .iter()
            .enumerate()
            .map(|(rank, &n)| gathered.f_select(0, rank as i64)?.f_narrow(0, 0, n))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| self.torch_error(e))?;
        Tensor::f_cat(&parts, 0).and_then(|t| t.f_movedim(0, dim)).map_err(|e| self.torch_error(e))
    }

    fn reduce_scatter(&self, tensor: &Tensor, dim: i64, op: ReduceOp) -> Result<Tensor> {
        let dims = tensor.dim() as i64;
        if dim < 0 || dim >= dims {
            return Err(Error::Invalid(format!("reduce_scatter along dimension {dim} of a {dims}-d tensor")));
        }
        let world = self.world_size as i64;
        let length = tensor.size()[dim as usize];
        if length % world != 0 {
            return Err(Error::Mismatch {
                rank: self.rank,
                message: format!("reduce_scatter: size {length} does not split into {world} chunks"),
            });
        }
        let input = tensor.f_movedim(dim, 0).and_then(|t| t.f_contiguous()).map_err(|e| self.torch_error(e))?;
        let dtype = self.check_tensor(&input, "reduce_scatter")?;
        let mut shape = input.size();
        shape[0] /= world;
        let out = Tensor::f_empty(shape.as_slice(), (input.kind(), input.device())).map_err(|e| self.torch_error(e))?;
        let (api, comm) = self.ready("reduce_scatter")?;
        // SAFETY: `input` holds world × out.numel() contiguous elements, `out` out.numel(),
        // both on this GPU with the same dtype.
        let status = unsafe {
            (api.reduce_scatter)(
                input.data_ptr(),
                out.data_ptr(),
                out.numel(),
                dtype,
                reduce_op(op),
                comm.0,
                std::ptr::null_mut(),
            )
        };
        check(api, status, "ncclReduceScatter")?;
        out.f_movedim(0, dim).map_err(|e| self.torch_error(e))
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<()> {
        if root >= self.world_size {
            return Err(Error::Invalid(format!("broadcast from rank {root} in a group of {}", self.world_size)));
        }
        let contiguous = tensor.is_contiguous();
        let buffer =
            if contiguous { tensor.shallow_clone() } else { tensor.f_contiguous().map_err(|e| self.torch_error(e))? };
        let dtype = self.check_tensor(&buffer, "broadcast")?;
        let (api, comm) = self.ready("broadcast")?;
        let ptr = buffer.data_ptr();
        // SAFETY: in-place broadcast of a contiguous buffer on this GPU.
        let status =
            unsafe { (api.broadcast)(ptr, ptr, buffer.numel(), dtype, root as c_int, comm.0, std::ptr::null_mut()) };
        check(api, status, "ncclBroadcast")?;
        if !contiguous {
            tensor.f_copy_(&buffer).map_err(|e| self.torch_error(e))?;
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        let mut token =
            Tensor::f_zeros([1], (Kind::Float, Device::Cuda(self.ordinal))).map_err(|e| self.torch_error(e))?;
        self.all_reduce(&mut token, ReduceOp::Sum)?;
        self.context.synchronize().map_err(|e| Error::Invalid(format!("cuda:{}: {e}", self.ordinal)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_ids_round_trip_through_bytes() {
        let mut bytes = vec![0u8; 128];
        bytes[0] = 200;
        bytes[127] = 7;
        let id = UniqueId::from_bytes(&bytes).expect("128 bytes");
        assert_eq!(id.to_bytes(), bytes);
        assert!(UniqueId::from_bytes(&bytes[..100]).is_err());
    }

    /// Where NCCL is on the library path (scripts/test adds torch's copy), it loads, answers
    /// and makes unique ids (no GPU needed); where it is not, the error says so.
    #[test]
    fn the_nccl_library_loads_or_is_reported_missing() {
        match version() {
            Ok(version) => {
                assert!(version >= 21800, "NCCL {version} is older than 2.18");
                let id = UniqueId::new().expect("a unique id from a loaded NCCL");
                assert!(id.to_bytes().iter().any(|&b| b != 0), "an id with content");
            }
            Err(e) => assert!(e.to_string().contains("libnccl.so.2"), "{e}"),
        }
    }

    /// Without the CUDA driver the group is an error naming it, not a panic. With a GPU
    /// (the device tool's machines) a one-rank group reduces, gathers, scatters and
    /// broadcasts like the CPU backend.
    #[test]
    fn a_one_gpu_group_works_or_names_what_is_missing() {
        assert!(NcclGroup::new(&[]).is_err());
        let has_driver = unsafe { cudarc::driver::sys::is_culib_present() };
        let group = match NcclGroup::new(&[0]) {
            Ok(group) => group,
            Err(e) => {
                let message = e.to_string();
                if !has_driver {
                    assert!(message.contains("CUDA driver"), "{message}");
                }
                assert!(message.contains("CUDA") || message.contains("NCCL"), "{message}");
                return;
            }
        };
        let comm = &group[0];
        let on_gpu = |values: &[f32], shape: &[i64]| Tensor::from_slice(values).view(shape).to_device(Device::Cuda(0));
        let back = |t: &Tensor| Vec::<f32>::try_from(t.flatten(0, -1).to_device(Device::Cpu)).expect("f32");
        let mut x = on_gpu(&[1.0, -2.0, 3.5, 4.0], &[2, 2]);
        comm.all_reduce(&mut x, ReduceOp::Sum).expect("all_reduce");
        assert_eq!(back(&x), [1.0, -2.0, 3.5, 4.0]);
        let mut t = on_gpu(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).transpose(0, 1);
        comm.all_reduce(&mut t, ReduceOp::Max).expect("a non-contiguous all_reduce");
        assert_eq!(back(&t), [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        let gathered = comm.all_gather(&on_gpu(&[1.0, 2.0, 3.0], &[1, 3]), 1).expect("all_gather");
        assert_eq!((gathered.size(), back(&gathered)), (vec![1, 3], vec![1.0, 2.0, 3.0]));
        let scattered = comm.reduce_scatter(&on_gpu(&[1.0, 2.0], &[2]), 0, ReduceOp::Sum).expect("reduce_scatter");
        assert_eq!(back(&scattered), [1.0, 2.0]);
        let mut b = on_gpu(&[7.0], &[1]);
        comm.broadcast(&mut b, 0).expect("broadcast");
        comm.barrier().expect("barrier");
        assert_eq!(back(&b), [7.0]);
        let cpu = Tensor::from_slice(&[1.0f32]);
        assert!(comm.all_gather(&cpu, 0).is_err(), "a CPU tensor is refused");
    }
}
