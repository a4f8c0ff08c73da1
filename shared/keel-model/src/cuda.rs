//! CUDA kernels for inference, written in CUDA C (`cuda/kernels.cu`), compiled by NVRTC
//! when a generator starts and launched through cudarc on the tensors' own device memory:
//! fused RMSNorm (with the residual add), rotary embedding, SiLU·mul and decode attention
//! that reads keys and values through the paged cache's block tables (no gather).
//!
//! Nothing here is needed: every kernel replaces a tch path that stays. [`Kernels::load`]
//! compiles the program for the device's architecture, then checks each kernel against its
//! tch path on random inputs of every dtype asked for; a kernel that fails to compile, load
//! or agree is switched off and named in [`Kernels::fallbacks`], and the model keeps using
//! tch for it. Kernels run only on tensors that need no gradient (they have no backward).
//!
//! Launches go to libtorch's current stream (through the [`graph`] shim once it is loaded,
//! the capture stream during a CUDA graph capture; the legacy default stream before), so
//! kernels and tch ops run in the order they are issued. `launch` holds the launch shapes,
//! checked on the host.

pub mod check;
pub mod graph;
pub mod ipc;
pub mod launch;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};
use tch::{Device, Kind, Tensor};

use launch::LaunchShape;

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("cuda/kernels.cu");

/// The kernels, by the names their entry points carry (`keel_<name>_<dtype>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kernel {
    RmsNorm,
    Rotary,
    SiluMul,
    /// Decode attention over the paged cache, with its reduction over context splits.
    PagedDecode,
}

impl Kernel {
    pub const ALL: [Kernel; 4] = [Kernel::RmsNorm, Kernel::Rotary, Kernel::SiluMul, Kernel::PagedDecode];

    pub fn name(self) -> &'static str {
        match self {
            Kernel::RmsNorm => "rms_norm",
            Kernel::Rotary => "rotary",
            Kernel::SiluMul => "silu_mul",
            Kernel::PagedDecode => "paged_decode",
        }
    }

    /// The entry points this kernel launches.
    fn entry_points(self) -> &'static [&'static str] {
        match self {
            Kernel::RmsNorm => &["rms_norm"],
            Kernel::Rotary => &["rotary"],
            Kernel::SiluMul => &["silu_mul"],
            Kernel::PagedDecode => &["paged_decode", "paged_reduce"],
        }
    }
}

pub use crate::error::KernelError;

type Result<T, E = KernelError> = std::result::Result<T, E>;

fn dtype_suffix(kind: Kind) -> Result<&'static str> {
    match kind {
        Kind::Float => Ok("f32"),
        Kind::BFloat16 => Ok("bf16"),
        Kind::Half => Ok("f16"),
        other => Err(KernelError::Shape(format!("no kernels for {other:?} tensors (f32, bf16 and f16 only)"))),
    }
}

/// Finds NVRTC and its builtins library: loadable by name, or the copies in the NVIDIA wheel
/// next to the libtorch this process runs (torch's wheels ship them in `nvidia/cu13/lib`),
/// loaded here so that cudarc and NVRTC find them by their sonames.
fn ensure_nvrtc() -> Result<()> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let torch_lib = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.ends_with("/libtorch_cpu.so"))
        .and_then(|path| std::path::Path::new(path).parent().map(std::path::Path::to_path_buf));
    let wheel = torch_lib.map(|lib| lib.join("../../nvidia/cu13/lib"));
    for name in ["libnvrtc-builtins.so.13.0", "libnvrtc.so.13"] {
        if let Some(path) = wheel.as_ref().map(|dir| dir.join(name)).filter(|p| p.is_file()) {
            let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL;
            // SAFETY: loading NVRTC runs no code of ours; the handle is leaked so the library
            // stays loaded for the process.
            #[allow(unsafe_code)]
            if let Ok(library) = unsafe { libloading::os::unix::Library::open(Some(&path), flags) } {
                std::mem::forget(library);
            }
        }
    }
    // SAFETY: only probes whether the library can be loaded.
    #[allow(unsafe_code)]
    let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if present {
        Ok(())
    } else {
        Err(KernelError::Unavailable("NVRTC (libnvrtc.so) was not found on the library path or beside torch".into()))
    }
}

/// Compiles [`SOURCE`] to PTX for `arch` (e.g. `compute_90`). Needs NVRTC, not a GPU.
pub fn compile(arch: &str) -> Result<cudarc::nvrtc::Ptx> {
    ensure_nvrtc()?;
    let options = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        name: Some("keel_kernels.cu".into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(SOURCE, options).map_err(|e| KernelError::Compile(e.to_string()))
}

/// A kernel argument, kept in place while a launch reads it.
enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl Arg {
    fn tensor(t: &Tensor) -> Arg {
        Arg::Ptr(t.data_ptr() as u64)
    }

    fn optional(t: Option<&Tensor>) -> Arg {
        Arg::Ptr(t.map_or(0, |t| t.data_ptr() as u64))
    }

    fn param(&mut self) -> *mut c_void {
        match self {
            Arg::Ptr(v) => (v as *mut u64).cast(),
            Arg::I32(v) => (v as *mut i32).cast(),
            Arg::I64(v) => (v as *mut i64).cast(),
            Arg::F32(v) => (v as *mut f32).cast(),
        }
    }
}

fn int32(v: i64, what: &str) -> Result<Arg> {
    i32::try_from(v).map(Arg::I32).map_err(|_| KernelError::Shape(format!("{what} {v} does not fit in 32 bits")))
}

/// The kernels loaded on one GPU.
pub struct Kernels {
    context: Arc<CudaContext>,
    ordinal: usize,
    functions: HashMap<String, CudaFunction>,
    /// Kernels switched off at load, and why.
    fallbacks: Vec<(Kernel, String)>,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels").field("ordinal", &self.ordinal).field("fallbacks", &self.fallbacks).finish()
    }
}

impl Kernels {
    /// Compiles and loads every kernel on `device` and checks each against its tch path in
    /// every dtype of `kinds`. Fails only when nothing can run (no CUDA, no NVRTC, a
    /// program the driver refuses); a single kernel that disagrees is switched off instead.
    pub fn load(device: Device, kinds: &[Kind]) -> Result<Self> {
        let Device::Cuda(ordinal) = device else {
            return Err(KernelError::Unavailable(format!("{device:?} is not a CUDA device")));
        };
        // SAFETY: only probes whether libcuda can be loaded.
        #[allow(unsafe_code)]
        let present = unsafe { cudarc::driver::sys::is_culib_present() };
        if !present {
            return Err(KernelError::Unavailable("the CUDA driver (libcuda.so) is not available".into()));
        }
        let driver = |e: cudarc::driver::DriverError| KernelError::Driver(e.to_string());
        let context = CudaContext::new(ordinal).map_err(driver)?;
        let (major, minor) = context.compute_capability().map_err(driver)?;
        let module = context.load_module(compile(&format!("compute_{major}{minor}"))?).map_err(driver)?;
        let mut functions = HashMap::new();
        for kernel in Kernel::ALL {
            for entry in kernel.entry_points() {
                for suffix in ["f32", "bf16", "f16"] {
                    let name = format!("keel_{entry}_{suffix}");
                    functions.insert(name.clone(), module.load_function(&name).map_err(driver)?);
                }
            }
        }
        let mut kernels = Self { context, ordinal, functions, fallbacks: Vec::new() };
        for kernel in Kernel::ALL {
            for &kind in kinds {
                if let Err(e) = check::against_tch(&kernels, kernel, kind, device) {
                    kernels.switch_off(kernel, e.to_string());
                    break;
                }
            }
        }
        Ok(kernels)
    }

    fn switch_off(&mut self, kernel: Kernel, why: String) {
        for entry in kernel.entry_points() {
            self.functions.retain(|name, _| !name.starts_with(&format!("keel_{entry}_")));
        }
        self.fallbacks.push((kernel, why));
    }

    /// Kernels switched off at load, with the reason.
    pub fn fallbacks(&self) -> &[(Kernel, String)] {
        &self.fallbacks
    }

    /// Whether `kernel` runs on tensors of `kind` on `device` (false: use the tch path).
    pub fn runs(&self, kernel: Kernel, device: Device, kind: Kind) -> bool {
        device == Device::Cuda(self.ordinal)
            && dtype_suffix(kind).is_ok_and(|s| self.functions.contains_key(&format!("keel_{}_{s}", kernel.name())))
    }

    fn launch(&self, entry: &str, kind: Kind, shape: LaunchShape, args: &mut [Arg]) -> Result<()> {
        let name = format!("keel_{entry}_{}", dtype_suffix(kind)?);
        let function = self.functions.get(&name).ok_or_else(|| KernelError::Unavailable(format!("{name} is off")))?;
        self.context.bind_to_thread().map_err(|e| KernelError::Driver(e.to_string()))?;
        let mut params: Vec<*mut c_void> = args.iter_mut().map(Arg::param).collect();
        let stream = graph::current_stream(self.ordinal).unwrap_or(std::ptr::null_mut());
        // SAFETY: the arguments match the entry point's parameter list in kernels.cu, every
        // pointer is the data of a live CUDA tensor of this device whose extent the checks in
        // the callers guarantee, and the launch goes to libtorch's current stream (the legacy
        // default stream, null, until the graph shim is loaded), after libtorch's work.
        #[allow(unsafe_code)]
        unsafe {
            cudarc::driver::result::launch_kernel(
                function.cu_function(),
                shape.grid,
                shape.block,
                shape.shared_bytes,
                stream.cast(),
                &mut params,
            )
        }
        .map_err(|e| KernelError::Driver(format!("{name}: {e}")))
    }

    /// RMSNorm of the last dimension of `x` (`weight` · normed, f32 inside); with `residual`,
    /// of `x + residual`, which is returned too. Returns (normed, sum).
    pub fn rms_norm(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        weight: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let cols = *x.size().last().unwrap_or(&0);
        let x = x.f_contiguous()?;
        let residual = residual.map(Tensor::f_contiguous).transpose()?;
        if let Some(r) = &residual {
            same("residual", r, &x)?;
        }
        if weight.size() != [cols] || weight.kind() != x.kind() || weight.device() != x.device() {
            return Err(KernelError::Shape(format!(
                "rms_norm weight {:?} {:?} for rows of {cols} {:?}",
                weight.size(),
                weight.kind(),
                x.kind()
            )));
        }
        let rows = x.numel() as i64 / cols.max(1);
        let out = x.f_empty_like()?;
        let sum = residual.as_ref().map(|_| x.f_empty_like()).transpose()?;
        let shape = launch::per_row(rows, cols)?;
        let mut args = [
            Arg::tensor(&out),
            Arg::optional(sum.as_ref()),
            Arg::tensor(&x),
            Arg::optional(residual.as_ref()),
            Arg::tensor(weight),
            int32(cols, "row length")?,
            Arg::F32(eps as f32),
        ];
        self.launch("rms_norm", x.kind(), shape, &mut args)?;
        Ok((out, sum))
    }

    /// Rotary embedding of `x` [B, H, S, D] with `cos`, `sin` [B, 1, S, D]: a new dense
    /// tensor, `x · cos + rotate_half(x) · sin` as [`crate::rope::apply`] computes it.
    pub fn rotary(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let size = x.size();
        let [b, h, s, d] = size[..] else {
            return Err(KernelError::Shape(format!("rotary input {size:?} is not [B, H, S, D]")));
        };
        if d % 2 != 0 || cos.size() != [b, 1, s, d] || sin.size() != cos.size() {
            return Err(KernelError::Shape(format!("rotary of {size:?} with cos {:?}", cos.size())));
        }
        let x = if x.stride()[3] == 1 { x.shallow_clone() } else { x.f_contiguous()? };
        let (cos, sin) = (cos.f_contiguous()?, sin.f_contiguous()?);
        // cos and sin are shared by the heads ([B, 1, S, D], checked above).
        same_kind("cos", &cos, &x)?;
        same_kind("sin", &sin, &x)?;
        let out = Tensor::f_empty([b, h, s, d], (x.kind(), x.device()))?;
        let pairs = b * h * s * (d / 2);
        let (stride, cs) = (x.stride(), cos.stride());
        let mut args = [
            Arg::tensor(&out),
            Arg::tensor(&x),
            Arg::tensor(&cos),
            Arg::tensor(&sin),
            Arg::I64(pairs),
            int32(h, "heads")?,
            int32(s, "sequence length")?,
            int32(d, "head size")?,
            Arg::I64(stride[0]),
            Arg::I64(stride[1]),
            Arg::I64(stride[2]),
            Arg::I64(cs[0]),
            Arg::I64(cs[2]),
        ];
        self.launch("rotary", x.kind(), launch::elementwise(pairs)?, &mut args)?;
        Ok(out)
    }

    /// `silu(gate) · up`, elementwise.
    pub fn silu_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let (gate, up) = (gate.f_contiguous()?, up.f_contiguous()?);
        same("up", &up, &gate)?;
        let out = gate.f_empty_like()?;
        let n = gate.numel() as i64;
        let mut args = [Arg::tensor(&out), Arg::tensor(&gate), Arg::tensor(&up), Arg::I64(n)];
        self.launch("silu_mul", gate.kind(), launch::elementwise(n)?, &mut args)?;
        Ok(out)
    }

    /// Decode attention of `q` [heads, rows, D] (one token per row) over the paged pools
    /// `keys`, `values` [kv_heads, slots, D], row r reading its first `lens[r]` keys through
    /// `tables` [rows, width] (int32 block ids of `block_size` slots); `window` keeps each
    /// row's last `window` keys. `max_len` is the largest of `lens` (known on the host).
    /// Returns [heads, rows, D].
    #[allow(clippy::too_many_arguments)]
    pub fn paged_decode(
        &self,
        q: &Tensor,
        keys: &Tensor,
        values: &Tensor,
        tables: &Tensor,
        lens: &Tensor,
        max_len: i64,
        block_size: i64,
        window: Option<i64>,
    ) -> Result<Tensor> {
        let [heads, rows, dim] = q.size()[..] else {
            return Err(KernelError::Shape(format!("decode query {:?} is not [heads, rows, D]", q.size())));
        };
        let [kv_heads, slots, kdim] = keys.size()[..] else {
            return Err(KernelError::Shape(format!("key pool {:?} is not [kv_heads, slots, D]", keys.size())));
        };
        let q = if q.stride()[2] == 1 { q.shallow_clone() } else { q.f_contiguous()? };
        if kdim != dim || kv_heads < 1 || heads % kv_heads != 0 || values.size() != keys.size() {
            return Err(KernelError::Shape(format!(
                "decode attention of {heads} heads of {dim} over pools {:?} / {:?}",
                keys.size(),
                values.size()
            )));
        }
        if !keys.is_contiguous() || !values.is_contiguous() || keys.kind() != q.kind() || values.kind() != q.kind() {
            return Err(KernelError::Shape("the pools must be dense and of the query's dtype".into()));
        }
        let width = *tables.size().last().unwrap_or(&0);
        if tables.size() != [rows, width]
            || tables.kind() != Kind::Int
            || lens.size() != [rows]
            || lens.kind() != Kind::Int
        {
            return Err(KernelError::Shape(format!(
                "block tables {:?} {:?} and lengths {:?} {:?} for {rows} rows (int32 expected)",
                tables.size(),
                tables.kind(),
                lens.size(),
                lens.kind()
            )));
        }
        if max_len > width * block_size || slots < block_size {
            return Err(KernelError::Shape(format!("{max_len} keys past {width} blocks of {block_size}")));
        }
        let visible = window.map_or(max_len, |w| w.min(max_len));
        let (shape, partition, splits) = launch::paged_decode(heads, rows, visible, dim)?;
        let out = Tensor::f_empty([heads, rows, dim], (q.kind(), q.device()))?;
        let float = (Kind::Float, q.device());
        let (part_out, part_ml) = if splits > 1 {
            (
                Some(Tensor::f_empty([heads, rows, splits, dim], float)?),
                Some(Tensor::f_empty([heads, rows, splits, 2], float)?),
            )
        } else {
            (None, None)
        };
        let mut args = [
            Arg::tensor(&out),
            Arg::optional(part_out.as_ref()),
            Arg::optional(part_ml.as_ref()),
            Arg::tensor(&q),
            Arg::I64(q.stride()[0]),
            Arg::I64(q.stride()[1]),
            Arg::tensor(keys),
            Arg::tensor(values),
            Arg::I64(slots * dim),
            Arg::tensor(tables),
            int32(width, "block table width")?,
            Arg::tensor(lens),
            int32(rows, "rows")?,
            int32(heads / kv_heads, "query heads per KV head")?,
            int32(dim, "head size")?,
            Arg::F32((dim as f64).powf(-0.5) as f32),
            int32(window.unwrap_or(0), "window")?,
            int32(partition, "partition")?,
            int32(block_size, "block size")?,
        ];
        self.launch("paged_decode", q.kind(), shape, &mut args)?;
        if let (Some(part_out), Some(part_ml)) = (&part_out, &part_ml) {
            let mut args = [
                Arg::tensor(&out),
                Arg::tensor(part_out),
                Arg::tensor(part_ml),
                int32(rows, "rows")?,
                int32(splits, "splits")?,
                int32(dim, "head size")?,
            ];
            self.launch("paged_reduce", q.kind(), launch::paged_reduce(heads, rows, dim)?, &mut args)?;
        }
        Ok(out)
    }
}

/// `t` has the dtype and device of `like` (any shape).
fn same_kind(what: &str, t: &Tensor, like: &Tensor) -> Result<()> {
    if t.kind() != like.kind() || t.device() != like.device() {
        return Err(KernelError::Shape(format!(
            "{what} is {:?} on {:?}, expected {:?} on {:?}",
            t.kind(),
            t.device(),
            like.kind(),
            like.device()
        )));
    }
    Ok(())
}

/// `t` has the shape, dtype and device of `like`.
fn same(what: &str, t: &Tensor, like: &Tensor) -> Result<()> {
    if t.size() != like.size() || t.kind() != like.kind() || t.device() != like.device() {
        return Err(KernelError::Shape(format!(
            "{what} is {:?} {:?} on {:?}, expected {:?} {:?} on {:?}",
            t.size(),
            t.kind(),
            t.device(),
            like.size(),
            like.kind(),
            like.device()
        )));
    }
    Ok(())
}
