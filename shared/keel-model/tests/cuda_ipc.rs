//! CUDA IPC between two processes on one GPU, as a colocated refit does it: this process
//! packs a model's weights into one GPU buffer (`pack_on_device`) and shares it
//! (`cuda::ipc::share`); a second process (this test binary again, running
//! `child_copies_the_buckets`) copies every bucket out of it and sends back each tensor's
//! bytes as a checksum; both must equal the weights exactly. The exporting process reads its
//! own handles at their address (CUDA opens none in the process that made it). Needs a GPU:
//! without one the test says it was skipped.

#![allow(clippy::unwrap_used)]

use keel_model::cuda::ipc;
use keel_model::packing::{pack_on_device, unpack_tensor};
use keel_protocol::generator::CudaIpcBuffer;
use tch::{Device, Kind, Tensor};

const CHILD: &str = "KEEL_CUDA_IPC_CHILD";

/// What the child gets: each bucket's handle, size and tensors.
type Shared = Vec<(CudaIpcBuffer, u64, Vec<keel_model::packing::Entry>)>;

/// A fingerprint of a tensor's bytes that any bit flip changes.
fn fingerprint(t: &Tensor) -> Vec<i64> {
    let bytes = t.contiguous().view([-1]).view_dtype(Kind::Uint8).to_device(Device::Cpu).to_kind(Kind::Int64);
    let weights = Tensor::arange(bytes.numel() as i64, (Kind::Int64, Device::Cpu)).remainder(9973) + 1;
    vec![bytes.sum(Kind::Int64).int64_value(&[]), (bytes * weights).sum(Kind::Int64).int64_value(&[])]
}

fn cuda() -> Option<Device> {
    match keel_model::device::parse_device("cuda") {
        Ok(device) => Some(device),
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

#[test]
fn another_process_copies_the_exported_buckets() {
    let Some(device) = cuda() else { return };
    tch::manual_seed(3);
    let tensors: Vec<(String, Tensor)> =
        (0..6).map(|i| (format!("layer.{i}.weight"), Tensor::randn([64 + i, 48], (Kind::Float, device)))).collect();
    for kind in [Kind::BFloat16, Kind::Float] {
        // 16 KiB buckets: several per export, all in one allocation (one handle).
        let packed = pack_on_device(&tensors, kind, 16 << 10, device).unwrap();
        assert!(packed.buckets.len() > 2, "{} buckets", packed.buckets.len());
        let offsets: Vec<u64> = packed.buckets.iter().map(|(at, _, _)| *at).collect();
        let handles = ipc::share(&packed.buffer, &offsets).unwrap();
        let shared: Shared = handles
            .into_iter()
            .zip(&packed.buckets)
            .map(|(h, (_, size, entries))| (h, *size, entries.clone()))
            .collect();
        let want: Vec<(String, Vec<i64>)> =
            tensors.iter().map(|(name, t)| (name.clone(), fingerprint(&t.to_kind(kind)))).collect();

        // The exporting process itself reads its buckets at their address.
        let own: Vec<(&CudaIpcBuffer, u64)> = shared.iter().map(|(h, size, _)| (h, *size)).collect();
        assert_eq!(copied(&shared, ipc::fetch(&own).unwrap(), kind), want, "{kind:?}, same process");

        // Another process opens the handle.
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_copies_the_buckets", "--nocapture", "--test-threads", "1"])
            .env(CHILD, serde_json::to_string(&(format!("{kind:?}"), &shared)).unwrap())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "child failed: {stdout}\n{}", String::from_utf8_lossy(&output.stderr));
        // The harness prints the test's name on the same line, before it.
        let line = stdout
            .lines()
            .find_map(|l| l.split_once("FINGERPRINTS "))
            .map(|(_, json)| json)
            .unwrap_or_else(|| panic!("{stdout}"));
        let got: Vec<(String, Vec<i64>)> = serde_json::from_str(line).unwrap();
        assert_eq!(got, want, "{kind:?}, another process");
        eprintln!("{kind:?}: {} buckets copied by another process, bit for bit", shared.len());
    }
    // A handle that is not one is refused by name.
    let bad =
        CudaIpcBuffer { handle: "00".into(), offset: 0, device_uuid: ipc::device_uuid(0).unwrap(), pid: 1, address: 0 };
    let error = ipc::fetch(&[(&bad, 4)]).unwrap_err().to_string();
    assert!(error.contains("64 bytes in hex"), "{error}");
}

fn copied(shared: &Shared, copies: Vec<Tensor>, kind: Kind) -> Vec<(String, Vec<i64>)> {
    shared
        .iter()
        .zip(copies)
        .flat_map(|((_, _, entries), copy)| unpack_tensor(&copy, entries, kind).unwrap())
        .map(|(name, t)| (name, fingerprint(&t)))
        .collect()
}

/// The second process of the test above (does nothing when run on its own).
#[test]
fn child_copies_the_buckets() {
    let Ok(request) = std::env::var(CHILD) else { return };
    let (kind, shared): (String, Shared) = serde_json::from_str(&request).unwrap();
    let kind = if kind == "Float" { Kind::Float } else { Kind::BFloat16 };
    let handles: Vec<(&CudaIpcBuffer, u64)> = shared.iter().map(|(h, size, _)| (h, *size)).collect();
    let copies = ipc::fetch(&handles).unwrap();
    println!("FINGERPRINTS {}", serde_json::to_string(&copied(&shared, copies, kind)).unwrap());
}
