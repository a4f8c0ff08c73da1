//! The TCP backend: ranks in separate processes, on one machine or several, on the CPU. For
//! CPU runs and tests of groups whose ranks cannot share memory (the thread backend,
//! [`crate::cpu`], cannot cross a process).
//!
//! Rank 0 is the hub: every other rank keeps one TCP connection to it. In each operation
//! every rank sends rank 0 its tensor (with the operation's name, its argument, dtype and
//! shape); rank 0 checks that they agree, combines them in rank order exactly as the thread
//! backend does (so both give bit-identical results) and sends every rank its result. The
//! traffic through rank 0 grows with the group, which is right for the small CPU groups this
//! backend is for; GPUs use NCCL.
//!
//! Failures end the group on every rank instead of hanging: a rank that exits closes its
//! connection, rank 0's next read of it fails, and rank 0 tells every other rank why and
//! closes their connections; a rank 0 that exits closes them all. Every read and write waits
//! at most the group's timeout. Ranks that disagree (shapes, dtypes, operations) get
//! [`Error::Mismatch`] on every rank and the group goes on.

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tch::{Kind, Tensor};

use crate::{Collective, Error, ReduceOp, Result};

/// The first bytes of a rank's hello, so that a stray connection is refused.
const MAGIC: &[u8; 8] = b"KEELTCP1";
/// The longest a rank waits between tries to reach rank 0 while it is not listening yet, and
/// rank 0 between looks for the ranks that connect (the waits grow to it from 1 ms).
const RETRY: Duration = Duration::from_millis(50);

/// What a rank asks for in one operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    AllReduce(ReduceOp),
    AllGather(i64),
    ReduceScatter(i64, ReduceOp),
    Broadcast(usize),
    Barrier,
    /// [`TcpCollective::broadcast_bytes`] from a root.
    Bytes(usize),
    /// [`TcpCollective::all_gather_bytes`].
    GatherBytes,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce(_) => "all_reduce",
            Op::AllGather(_) => "all_gather",
            Op::ReduceScatter(..) => "reduce_scatter",
            Op::Broadcast(_) => "broadcast",
            Op::Barrier => "barrier",
            Op::Bytes(_) => "broadcast_bytes",
            Op::GatherBytes => "all_gather_bytes",
        }
    }

    fn encode(self) -> [u8; 10] {
        let reduce = |op: ReduceOp| match op {
            ReduceOp::Sum => 0u8,
            ReduceOp::Max => 1,
        };
        let (code, sub, arg) = match self {
            Op::AllReduce(op) => (1u8, reduce(op), 0i64),
            Op::AllGather(dim) => (2, 0, dim),
            Op::ReduceScatter(dim, op) => (3, reduce(op), dim),
            Op::Broadcast(root) => (4, 0, root as i64),
            Op::Barrier => (5, 0, 0),
            Op::Bytes(root) => (6, 0, root as i64),
            Op::GatherBytes => (7, 0, 0),
        };
        let mut out = [0u8; 10];
        out[0] = code;
        out[1] = sub;
        out[2..].copy_from_slice(&arg.to_le_bytes());
        out
    }

    fn decode(bytes: [u8; 10]) -> Option<Self> {
        let reduce = match bytes[1] {
            0 => ReduceOp::Sum,
            1 => ReduceOp::Max,
            _ => return None,
        };
        let arg = i64::from_le_bytes(bytes[2..].try_into().ok()?);
        Some(match bytes[0] {
            1 => Op::AllReduce(reduce),
            2 => Op::AllGather(arg),
            3 => Op::ReduceScatter(arg, reduce),
            4 => Op::Broadcast(usize::try_from(arg).ok()?),
            5 => Op::Barrier,
            6 => Op::Bytes(usize::try_from(arg).ok()?),
            7 => Op::GatherBytes,
            _ => return None,
        })
    }
}

/// The dtypes a tensor may have on the wire.
const KINDS: [Kind; 10] = [
    Kind::Float,
    Kind::Double,
    Kind::Half,
    Kind::BFloat16,
    Kind::Int64,
    Kind::Int,
    Kind::Int16,
    Kind::Int8,
    Kind::Uint8,
    Kind::Bool,
];

/// A rank's contribution or result: a tensor's dtype, shape and bytes, or plain bytes.
#[derive(Debug, Clone, PartialEq)]
struct Payload {
    kind: u8,
    shape: Vec<i64>,
    data: Vec<u8>,
}

impl Payload {
    /// Plain bytes (no tensor).
    const BYTES: u8 = u8::MAX;

    fn of(tensor: &Tensor) -> Result<Self> {
        let kind = KINDS
            .iter()
            .position(|k| *k == tensor.kind())
            .ok_or_else(|| Error::Invalid(format!("the TCP backend does not carry {:?} tensors", tensor.kind())))?;
        let host = tensor.f_to_device(tch::Device::Cpu).and_then(|t| t.f_contiguous()).map_err(invalid)?;
        let numel = host.numel();
        let mut data = vec![0u8; numel * tensor.kind().elt_size_in_bytes()];
        host.f_copy_data_u8(&mut data, numel).map_err(invalid)?;
        Ok(Self { kind: kind as u8, shape: tensor.size(), data })
    }

    fn header(shape: Vec<i64>, kind: Kind) -> Self {
        let kind = KINDS.iter().position(|k| *k == kind).map_or(Self::BYTES, |k| k as u8);
        Self { kind, shape, data: Vec::new() }
    }

    fn bytes(data: Vec<u8>) -> Self {
        Self { kind: Self::BYTES, shape: Vec::new(), data }
    }

    fn tensor(&self) -> Result<Tensor> {
        let kind = *KINDS
            .get(usize::from(self.kind))
            .ok_or_else(|| Error::Invalid(format!("dtype code {} is no tensor", self.kind)))?;
        Tensor::f_from_data_size(&self.data, &self.shape, kind).map_err(invalid)
    }

    fn write(&self, out: &mut impl Write) -> std::io::Result<()> {
        out.write_all(&[self.kind, self.shape.len() as u8])?;
        for d in &self.shape {
            out.write_all(&d.to_le_bytes())?;
        }
        out.write_all(&(self.data.len() as u64).to_le_bytes())?;
        out.write_all(&self.data)
    }

    fn read(input: &mut impl Read) -> std::io::Result<Self> {
        let mut head = [0u8; 2];
        input.read_exact(&mut head)?;
        let shape = (0..head[1]).map(|_| read_i64(input)).collect::<std::io::Result<Vec<_>>>()?;
        let length = usize::try_from(read_i64(input)?)
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "a negative length"))?;
        let mut data = vec![0u8; length];
        input.read_exact(&mut data)?;
        Ok(Self { kind: head[0], shape, data })
    }
}

fn read_i64(input: &mut impl Read) -> std::io::Result<i64> {
    let mut bytes = [0u8; 8];
    input.read_exact(&mut bytes)?;
    Ok(i64::from_le_bytes(bytes))
}

fn invalid(e: impl std::fmt::Display) -> Error {
    Error::Invalid(e.to_string())
}

/// What rank 0 answers each rank.
const OK: u8 = 0;
const MISMATCH: u8 = 1;
const ABORTED: u8 = 2;

/// One rank's connections.
#[derive(Debug)]
enum Link {
    /// Rank 0: a connection to each other rank, in rank order (rank 1 first).
    Hub(Vec<TcpStream>),
    /// Any other rank: its connection to rank 0.
    Spoke(TcpStream),
    /// The group failed; every operation says why.
    Broken(String),
}

/// One rank of a group over TCP (see the module's documentation).
#[derive(Debug)]
pub struct TcpCollective {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    link: Mutex<Link>,
}

impl Drop for TcpCollective {
    /// Closing the connections is the leaving: the others' next operation fails.
    fn drop(&mut self) {
        let link = self.link.get_mut().unwrap_or_else(|e| e.into_inner());
        match link {
            Link::Hub(peers) => {
                let why = if std::thread::panicking() { "rank 0 panicked" } else { "rank 0 left the group" };
                for peer in peers.iter_mut() {
                    let _ = tell_aborted(peer, why);
                    let _ = peer.shutdown(Shutdown::Both);
                }
            }
            Link::Spoke(hub) => {
                let _ = hub.shutdown(Shutdown::Both);
            }
            Link::Broken(_) => {}
        }
    }
}

fn tell_aborted(peer: &mut TcpStream, reason: &str) -> std::io::Result<()> {
    let mut out = BufWriter::new(peer);
    out.write_all(&[ABORTED])?;
    Payload::bytes(reason.as_bytes().to_vec()).write(&mut out)?;
    out.flush()
}

/// The address of this machine that `remote` (a host name or address, with a port) is
/// reached from: the one other ranks on that network can connect to. Nothing is sent.
pub fn local_ip_towards(remote: &str) -> Result<IpAddr> {
    let socket = UdpSocket::bind(("0.0.0.0", 0)).map_err(invalid)?;
    socket.connect(remote).map_err(|e| Error::Invalid(format!("no route to {remote}: {e}")))?;
    Ok(socket.local_addr().map_err(invalid)?.ip())
}

impl TcpCollective {
    /// Rank 0's side: waits on `listener` for ranks `1..world_size` to say hello with the
    /// group's `token`, each once; gives up after `timeout`.
    pub fn accept(listener: &TcpListener, world_size: usize, token: &str, timeout: Duration) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::Invalid("a group needs at least one rank".into()));
        }
        let deadline = Instant::now() + timeout;
        listener.set_nonblocking(true).map_err(invalid)?;
        let mut peers: Vec<Option<TcpStream>> = (1..world_size).map(|_| None).collect();
        let mut backoff = crate::backoff(RETRY);
        while peers.iter().any(Option::is_none) {
            let (mut stream, from) = match listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> =
                            peers.iter().enumerate().filter(|(_, p)| p.is_none()).map(|(i, _)| i + 1).collect();
                        return Err(Error::Invalid(format!(
                            "rank 0: ranks {missing:?} did not join within {} s",
                            timeout.as_secs_f64()
                        )));
                    }
                    std::thread::sleep(backoff.next().unwrap_or(RETRY));
                    continue;
                }
                Err(e) => return Err(invalid(e)),
            };
            stream.set_nonblocking(false).map_err(invalid)?;
            configure(&stream, timeout)?;
            // A bad hello is refused and the wait goes on (a stray or late connection).
            match read_hello(&mut stream, world_size, token) {
                Ok(rank) if peers[rank - 1].is_none() => {
                    stream.write_all(&[OK]).map_err(invalid)?;
                    peers[rank - 1] = Some(stream);
                }
                Ok(rank) => {
                    let _ = refuse(&mut stream, &format!("rank {rank} is already in the group"));
                }
                Err(why) => {
                    let _ = refuse(&mut stream, &format!("refused {from}: {why}"));
                }
            }
        }
        let peers = peers.into_iter().flatten().collect();
        Ok(Self { rank: 0, world_size, timeout, link: Mutex::new(Link::Hub(peers)) })
    }

    /// Rank `rank`'s side (not 0): connects to rank 0 at `hub` and says hello; retries while
    /// rank 0 is not listening yet, up to `timeout`.
    pub fn connect(hub: SocketAddr, rank: usize, world_size: usize, token: &str, timeout: Duration) -> Result<Self> {
        if rank == 0 || rank >= world_size {
            return Err(Error::Invalid(format!("rank {rank} cannot connect to rank 0 in a group of {world_size}")));
        }
        let deadline = Instant::now() + timeout;
        let mut backoff = crate::backoff(RETRY);
        let mut stream = loop {
            match TcpStream::connect_timeout(&hub, timeout) {
                Ok(stream) => break stream,
                Err(e) if Instant::now() >= deadline => {
                    return Err(Error::Invalid(format!("rank {rank}: cannot reach rank 0 at {hub}: {e}")));
                }
                Err(_) => std::thread::sleep(backoff.next().unwrap_or(RETRY)),
            }
        };
        configure(&stream, timeout)?;
        let mut hello = Vec::with_capacity(32 + token.len());
        hello.extend_from_slice(MAGIC);
        hello.extend_from_slice(&(rank as u32).to_le_bytes());
        hello.extend_from_slice(&(world_size as u32).to_le_bytes());
        hello.extend_from_slice(&(token.len() as u32).to_le_bytes());
        hello.extend_from_slice(token.as_bytes());
        stream.write_all(&hello).map_err(|e| Error::Invalid(format!("rank {rank}: hello to rank 0: {e}")))?;
        let mut answer = [0u8; 1];
        stream.read_exact(&mut answer).map_err(|e| Error::Invalid(format!("rank {rank}: rank 0's answer: {e}")))?;
        if answer[0] != OK {
            let why = Payload::read(&mut stream).map(|p| String::from_utf8_lossy(&p.data).into_owned());
            return Err(Error::Invalid(format!("rank {rank}: rank 0 refused: {}", why.unwrap_or_default())));
        }
        Ok(Self { rank, world_size, timeout, link: Mutex::new(Link::Spoke(stream)) })
    }

    /// Joins a group whose ranks find each other over NATS: rank 0 listens on `ip` (an
    /// address the others can reach, e.g. [`local_ip_towards`] the NATS server) and shares
    /// its address on `subject` (unique to the group); the others connect to it.
    pub async fn join(
        client: &async_nats::Client,
        subject: &str,
        rank: usize,
        world_size: usize,
        ip: IpAddr,
        timeout: Duration,
    ) -> Result<Self> {
        let listener = if rank == 0 { Some(TcpListener::bind((ip, 0)).map_err(invalid)?) } else { None };
        let address = match &listener {
            Some(listener) => listener.local_addr().map_err(invalid)?.to_string(),
            None => String::new(),
        };
        let shared =
            crate::bootstrap::share_id(client, subject, rank, world_size, || Ok(address.into_bytes()), timeout).await?;
        let hub: SocketAddr = String::from_utf8_lossy(&shared)
            .parse()
            .map_err(|e| Error::Invalid(format!("rank 0's address `{}`: {e}", String::from_utf8_lossy(&shared))))?;
        let token = subject.to_string();
        let joined = tokio::task::spawn_blocking(move || match listener {
            Some(listener) => Self::accept(&listener, world_size, &token, timeout),
            None => Self::connect(hub, rank, world_size, &token, timeout),
        });
        joined.await.map_err(|e| Error::Invalid(format!("rank {rank}: join: {e}")))?
    }

    /// `root`'s bytes on every rank (`bytes` is read on the root only): how a leader hands
    /// its requests to the other ranks of its group.
    pub fn broadcast_bytes(&self, bytes: &[u8], root: usize) -> Result<Vec<u8>> {
        self.check_root(root, "broadcast_bytes")?;
        let mine = if self.rank == root { Payload::bytes(bytes.to_vec()) } else { Payload::bytes(Vec::new()) };
        Ok(self.run(Op::Bytes(root), mine)?.data)
    }

    /// Every rank's bytes, in rank order, on every rank: how the ranks of a group tell their
    /// leader how an operation went.
    pub fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let gathered = self.run(Op::GatherBytes, Payload::bytes(bytes.to_vec()))?.data;
        split_gathered(&gathered, self.world_size)
            .ok_or_else(|| Error::Invalid(format!("rank {}: all_gather_bytes: a malformed answer", self.rank)))
    }

    fn check_root(&self, root: usize, operation: &str) -> Result<()> {
        if root >= self.world_size {
            return Err(Error::Invalid(format!("{operation} from rank {root} in a group of {}", self.world_size)));
        }
        Ok(())
    }

    /// One operation: this rank's `mine` in, this rank's result out.
    fn run(&self, op: Op, mine: Payload) -> Result<Payload> {
        let mut link = self.link.lock().unwrap_or_else(|e| e.into_inner());
        let outcome = match &mut *link {
            Link::Broken(reason) => {
                return Err(Error::Aborted { rank: self.rank, operation: op.name(), reason: reason.clone() });
            }
            Link::Spoke(hub) => self.as_spoke(hub, op, &mine),
            Link::Hub(peers) => self.as_hub(peers, op, mine),
        };
        match outcome {
            Ok(result) => result,
            // The group is over for this rank: close what is left so that the others learn it.
            Err(failure) => {
                let reason = failure.reason();
                if let Link::Hub(peers) = &mut *link {
                    for peer in peers.iter_mut() {
                        let _ = tell_aborted(peer, &reason);
                        let _ = peer.shutdown(Shutdown::Both);
                    }
                } else if let Link::Spoke(hub) = &mut *link {
                    let _ = hub.shutdown(Shutdown::Both);
                }
                *link = Link::Broken(reason);
                Err(failure.into_error(self.rank, op.name(), self.timeout))
            }
        }
    }

    /// Sends `mine`, reads the answer. `Err` ends the group; `Ok(Err)` is a mismatch.
    fn as_spoke(&self, hub: &mut TcpStream, op: Op, mine: &Payload) -> Result<Result<Payload>, Failure> {
        let mut out = BufWriter::new(&*hub);
        out.write_all(&op.encode()).map_err(|e| Failure::io("sending to rank 0", e))?;
        mine.write(&mut out).map_err(|e| Failure::io("sending to rank 0", e))?;
        out.flush().map_err(|e| Failure::io("sending to rank 0", e))?;
        drop(out);
        let mut input = BufReader::new(&*hub);
        let mut status = [0u8; 1];
        input.read_exact(&mut status).map_err(|e| Failure::io("waiting for rank 0", e))?;
        let answer = Payload::read(&mut input).map_err(|e| Failure::io("reading rank 0's answer", e))?;
        match status[0] {
            OK => Ok(Ok(answer)),
            MISMATCH => Ok(Err(Error::Mismatch { rank: self.rank, message: text(&answer) })),
            _ => Err(Failure::Aborted(text(&answer))),
        }
    }

    /// Gathers every rank's contribution, combines them and answers each rank.
    fn as_hub(&self, peers: &mut [TcpStream], op: Op, mine: Payload) -> Result<Result<Payload>, Failure> {
        let mut parts = vec![(op, mine)];
        for (index, peer) in peers.iter_mut().enumerate() {
            let rank = index + 1;
            let mut input = BufReader::new(&*peer);
            let mut code = [0u8; 10];
            input.read_exact(&mut code).map_err(|e| Failure::peer(rank, e))?;
            let theirs = Op::decode(code).ok_or_else(|| Failure::Aborted(format!("rank {rank} sent no operation")))?;
            let payload = Payload::read(&mut input).map_err(|e| Failure::peer(rank, e))?;
            parts.push((theirs, payload));
        }
        let results = combine(&parts, self.world_size);
        let mut own = None;
        for (rank, result) in results.into_iter().enumerate() {
            if rank == 0 {
                own = Some(result);
                continue;
            }
            let peer = &peers[rank - 1];
            let mut out = BufWriter::new(peer);
            let sent = match &result {
                Ok(payload) => out.write_all(&[OK]).and_then(|()| payload.write(&mut out)),
                Err(incompatible) => out
                    .write_all(&[MISMATCH])
                    .and_then(|()| Payload::bytes(incompatible.to_string().into_bytes()).write(&mut out)),
            };
            sent.and_then(|()| out.flush()).map_err(|e| Failure::peer(rank, e))?;
        }
        let own = own.unwrap_or_else(|| Err(Incompatible::Tensor("no result for rank 0".into())));
        Ok(own.map_err(|incompatible| Error::Mismatch { rank: 0, message: incompatible.to_string() }))
    }
}

/// The ranks' byte strings, each after its length (u64, little-endian).
fn join_gathered(parts: &[(Op, Payload)]) -> Payload {
    let mut out = Vec::with_capacity(parts.iter().map(|(_, p)| 8 + p.data.len()).sum());
    for (_, part) in parts {
        out.extend_from_slice(&(part.data.len() as u64).to_le_bytes());
        out.extend_from_slice(&part.data);
    }
    Payload::bytes(out)
}

/// [`join_gathered`] undone: `world_size` byte strings, or `None` when `bytes` is not that.
fn split_gathered(mut bytes: &[u8], world_size: usize) -> Option<Vec<Vec<u8>>> {
    let mut parts = Vec::with_capacity(world_size);
    for _ in 0..world_size {
        let length = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
        parts.push(bytes.get(8..8 + length)?.to_vec());
        bytes = &bytes[8 + length..];
    }
    bytes.is_empty().then_some(parts)
}

fn text(payload: &Payload) -> String {
    String::from_utf8_lossy(&payload.data).into_owned()
}

fn configure(stream: &TcpStream, timeout: Duration) -> Result<()> {
    stream.set_nodelay(true).map_err(invalid)?;
    stream.set_read_timeout(Some(timeout)).map_err(invalid)?;
    stream.set_write_timeout(Some(timeout)).map_err(invalid)
}

/// Why rank 0 refuses a connection's hello (the connection is told, and the wait goes on).
#[derive(Debug, thiserror::Error)]
enum BadHello {
    #[error("no hello: {0}")]
    Missing(std::io::Error),
    #[error("not a Keel rank")]
    NotKeel,
    #[error("a token longer than 4096 bytes")]
    LongToken,
    #[error("no token: {0}")]
    NoToken(std::io::Error),
    #[error("rank {0} belongs to another group")]
    OtherGroup(usize),
    #[error("rank {rank} thinks the group has {size} ranks, not {world_size}")]
    OtherSize { rank: usize, size: usize, world_size: usize },
    #[error("rank {rank} is not in 1..{world_size}")]
    OutOfRange { rank: usize, world_size: usize },
}

fn read_hello(stream: &mut TcpStream, world_size: usize, token: &str) -> std::result::Result<usize, BadHello> {
    let mut head = [0u8; 20];
    stream.read_exact(&mut head).map_err(BadHello::Missing)?;
    if &head[..8] != MAGIC {
        return Err(BadHello::NotKeel);
    }
    let word = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().unwrap_or_default()) as usize;
    let (rank, size, length) = (word(8), word(12), word(16));
    if length > 4096 {
        return Err(BadHello::LongToken);
    }
    let mut theirs = vec![0u8; length];
    stream.read_exact(&mut theirs).map_err(BadHello::NoToken)?;
    if theirs != token.as_bytes() {
        return Err(BadHello::OtherGroup(rank));
    }
    if size != world_size {
        return Err(BadHello::OtherSize { rank, size, world_size });
    }
    if rank == 0 || rank >= world_size {
        return Err(BadHello::OutOfRange { rank, world_size });
    }
    Ok(rank)
}

fn refuse(stream: &mut TcpStream, why: &str) -> std::io::Result<()> {
    stream.write_all(&[ABORTED])?;
    Payload::bytes(why.as_bytes().to_vec()).write(stream)
}

/// Why a rank's group ended.
#[derive(Debug)]
enum Failure {
    /// A read or write timed out.
    Timeout,
    /// A connection failed, or rank 0 said the group is over.
    Aborted(String),
}

impl Failure {
    fn io(what: &str, e: std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => Failure::Timeout,
            std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::ConnectionAborted => Failure::Aborted(format!("{what}: rank 0 left the group")),
            _ => Failure::Aborted(format!("{what}: {e}")),
        }
    }

    fn peer(rank: usize, e: std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                Failure::Aborted(format!("rank {rank} did not arrive in time"))
            }
            std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::ConnectionAborted => Failure::Aborted(format!("rank {rank} left the group")),
            _ => Failure::Aborted(format!("rank {rank}: {e}")),
        }
    }

    fn reason(&self) -> String {
        match self {
            Failure::Timeout => "a rank waited too long for rank 0".into(),
            Failure::Aborted(reason) => reason.clone(),
        }
    }

    fn into_error(self, rank: usize, operation: &'static str, timeout: Duration) -> Error {
        match self {
            Failure::Timeout => Error::Timeout { rank, operation, seconds: timeout.as_secs_f64() },
            Failure::Aborted(reason) => Error::Aborted { rank, operation, reason },
        }
    }
}

/// Every rank's result of one operation from every rank's (operation, contribution), in rank
/// order: what the thread backend computes, or why the ranks' calls cannot be combined.
fn combine(parts: &[(Op, Payload)], world_size: usize) -> Vec<std::result::Result<Payload, Incompatible>> {
    let all = |result: std::result::Result<Payload, Incompatible>| vec![result; world_size];
    let op = parts[0].0;
    if let Some((rank, (theirs, _))) = parts.iter().enumerate().find(|(_, (o, _))| *o != op) {
        return all(Err(Incompatible::Operation { rank, theirs: format!("{theirs:?}"), ours: format!("{op:?}") }));
    }
    if let Some((rank, (_, p))) = parts.iter().enumerate().find(|(_, (_, p))| p.kind != parts[0].1.kind) {
        let (theirs, ours) = (kind_name(p.kind), kind_name(parts[0].1.kind));
        return all(Err(Incompatible::Kind { op: op.name(), rank, theirs, ours }));
    }
    let same_shapes = || match parts.iter().position(|(_, p)| p.shape != parts[0].1.shape) {
        None => Ok(()),
        Some(rank) => Err(Incompatible::Shape {
            op: op.name(),
            rank,
            theirs: parts[rank].1.shape.clone(),
            ours: parts[0].1.shape.clone(),
        }),
    };
    let tensors = || parts.iter().map(|(_, p)| p.tensor()).collect::<Result<Vec<_>>>().map_err(Incompatible::tensor);
    let outcome = (|| -> std::result::Result<Vec<Payload>, Incompatible> {
        match op {
            Op::Barrier => Ok(vec![Payload::bytes(Vec::new()); world_size]),
            Op::Bytes(root) => Ok(vec![parts[root].1.clone(); world_size]),
            Op::GatherBytes => Ok(vec![join_gathered(parts); world_size]),
            Op::Broadcast(root) => {
                same_shapes()?;
                Ok(vec![parts[root].1.clone(); world_size])
            }
            Op::AllReduce(reduce) => {
                same_shapes()?;
                let result = Payload::of(&crate::reduce(&tensors()?, reduce)).map_err(Incompatible::tensor)?;
                Ok(vec![result; world_size])
            }
            Op::AllGather(dim) => {
                let gathered = Tensor::f_cat(&tensors()?, dim)
                    .map_err(|e| Incompatible::Tensor(format!("all_gather along {dim}: {e}")))?;
                Ok(vec![Payload::of(&gathered).map_err(Incompatible::tensor)?; world_size])
            }
            Op::ReduceScatter(dim, reduce) => {
                same_shapes()?;
                let reduced = crate::reduce(&tensors()?, reduce);
                (0..world_size)
                    .map(|rank| {
                        let chunk =
                            crate::scatter_chunk(&reduced, dim, rank, world_size).map_err(Incompatible::Split)?;
                        Payload::of(&chunk).map_err(Incompatible::tensor)
                    })
                    .collect()
            }
        }
    })();
    match outcome {
        Ok(results) => results.into_iter().map(Ok).collect(),
        Err(message) => all(Err(message)),
    }
}

/// Why the ranks' calls of one operation cannot be combined: every rank is told, as text,
/// and fails with [`Error::Mismatch`].
#[derive(Debug, Clone, thiserror::Error)]
enum Incompatible {
    #[error("rank {rank} called {theirs}, rank 0 {ours}")]
    Operation { rank: usize, theirs: String, ours: String },
    #[error("{op}: rank {rank} passed {theirs}, rank 0 {ours}")]
    Kind { op: &'static str, rank: usize, theirs: String, ours: String },
    #[error("{op}: rank {rank} passed shape {theirs:?}, rank 0 {ours:?}")]
    Shape { op: &'static str, rank: usize, theirs: Vec<i64>, ours: Vec<i64> },
    #[error(transparent)]
    Split(crate::BadSplit),
    /// libtorch failed combining the tensors.
    #[error("{0}")]
    Tensor(String),
}

impl Incompatible {
    fn tensor(e: Error) -> Self {
        Self::Tensor(e.to_string())
    }
}

fn kind_name(code: u8) -> String {
    KINDS.get(usize::from(code)).map_or_else(|| "bytes".into(), |k| format!("{k:?}"))
}

impl Collective for TcpCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        let result = self.run(Op::AllReduce(op), Payload::of(tensor)?)?.tensor()?;
        tensor.f_copy_(&result.f_to_device(tensor.device()).map_err(invalid)?).map_err(invalid)
    }

    fn all_gather(&self, tensor: &Tensor, dim: i64) -> Result<Tensor> {
        self.run(Op::AllGather(dim), Payload::of(tensor)?)?.tensor()?.f_to_device(tensor.device()).map_err(invalid)
    }

    fn reduce_scatter(&self, tensor: &Tensor, dim: i64, op: ReduceOp) -> Result<Tensor> {
        self.run(Op::ReduceScatter(dim, op), Payload::of(tensor)?)?
            .tensor()?
            .f_to_device(tensor.device())
            .map_err(invalid)
    }

    fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<()> {
        self.check_root(root, "broadcast")?;
        // Only the root's bytes travel; the others say their shape and dtype.
        let mine = if self.rank == root { Payload::of(tensor)? } else { Payload::header(tensor.size(), tensor.kind()) };
        let result = self.run(Op::Broadcast(root), mine)?;
        if self.rank != root {
            tensor.f_copy_(&result.tensor()?.f_to_device(tensor.device()).map_err(invalid)?).map_err(invalid)?;
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.run(Op::Barrier, Payload::bytes(Vec::new())).map(|_| ())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tch::Device;

    const TIMEOUT: Duration = Duration::from_secs(20);

    /// A group of `world` ranks over loopback TCP, each on its own thread running `f`;
    /// their results in rank order.
    pub(crate) fn on_ranks<T: Send + 'static>(
        world: usize,
        f: impl Fn(TcpCollective) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let hub = listener.local_addr().unwrap();
        let mut handles = Vec::new();
        for rank in (0..world).rev() {
            let f = f.clone();
            let listener = (rank == 0).then(|| listener.try_clone().unwrap());
            handles.push(std::thread::spawn(move || {
                let group = match listener {
                    Some(listener) => TcpCollective::accept(&listener, world, "test", TIMEOUT).unwrap(),
                    None => TcpCollective::connect(hub, rank, world, "test", TIMEOUT).unwrap(),
                };
                f(group)
            }));
        }
        let mut results: Vec<T> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        results.reverse();
        results
    }

    /// Every operation, on tensors whose sums round differently in another order.
    fn workload(c: &dyn Collective) -> Vec<Vec<u8>> {
        let rank = c.rank() as f64;
        let seeded = |n: i64| {
            (Tensor::arange(n, (Kind::Float, Device::Cpu)) * (0.1 + rank * 0.37)).sin() * 10f64.powf(rank - 1.0)
        };
        let bytes = |t: &Tensor| Payload::of(t).unwrap().data;
        let mut out = Vec::new();
        let mut sum = seeded(1000);
        c.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
        out.push(bytes(&sum));
        let mut max = seeded(10).to_kind(Kind::BFloat16);
        c.all_reduce(&mut max, ReduceOp::Max).unwrap();
        out.push(bytes(&max));
        let mut non_contiguous = seeded(12).view([3, 4]).transpose(0, 1);
        c.all_reduce(&mut non_contiguous, ReduceOp::Sum).unwrap();
        out.push(bytes(&non_contiguous));
        out.push(bytes(&c.all_gather(&seeded(6).view([2, 3]), 1).unwrap()));
        out.push(bytes(&c.reduce_scatter(&seeded(24).view([12, 2]), 0, ReduceOp::Sum).unwrap()));
        let mut ids = Tensor::from_slice(&[c.rank() as i64 * 7, 3]);
        c.broadcast(&mut ids, c.world_size() - 1).unwrap();
        out.push(bytes(&ids));
        c.barrier().unwrap();
        out
    }

    #[test]
    fn every_operation_gives_the_thread_backends_bits() {
        for world in [1, 2, 3, 4] {
            let tcp = on_ranks(world, |c| workload(&c));
            let threads = crate::cpu::tests::on_ranks(world, |c| workload(&c));
            assert_eq!(tcp, threads, "world {world}");
        }
    }

    #[test]
    fn bytes_from_any_root_reach_every_rank() {
        let results = on_ranks(3, |c| {
            let first = c.broadcast_bytes(b"from rank 1", 1).unwrap();
            let mine = format!("rank {} says hello", c.rank());
            let second = c.broadcast_bytes(mine.as_bytes(), 0).unwrap();
            (first, second)
        });
        for (first, second) in results {
            assert_eq!(first, b"from rank 1");
            assert_eq!(second, b"rank 0 says hello");
        }
    }

    #[test]
    fn every_ranks_bytes_reach_every_rank_in_rank_order() {
        let results = on_ranks(3, |c| c.all_gather_bytes(&vec![c.rank() as u8; c.rank() * 2]).unwrap());
        for gathered in results {
            assert_eq!(gathered, vec![vec![], vec![1, 1], vec![2, 2, 2, 2]]);
        }
        assert_eq!(split_gathered(&[1, 0, 0, 0, 0, 0, 0, 0], 1), None, "a length past the end");
        assert_eq!(split_gathered(&[0; 9], 1), None, "bytes left over");
    }

    #[test]
    fn disagreeing_ranks_get_an_error_each_and_the_group_goes_on() {
        let results = on_ranks(2, |c| {
            let mut bad = Tensor::zeros([2 + c.rank() as i64], (Kind::Float, Device::Cpu));
            let shapes = c.all_reduce(&mut bad, ReduceOp::Sum).unwrap_err().to_string();
            let mut kind = Tensor::zeros([2], (if c.rank() == 0 { Kind::Float } else { Kind::Double }, Device::Cpu));
            let kinds = c.all_reduce(&mut kind, ReduceOp::Sum).unwrap_err().to_string();
            let ops = if c.rank() == 0 { c.barrier() } else { c.broadcast_bytes(b"", 0).map(|_| ()) };
            let ops = ops.unwrap_err().to_string();
            let scatter = c.reduce_scatter(&Tensor::ones([3], (Kind::Float, Device::Cpu)), 0, ReduceOp::Sum);
            let mut good = Tensor::ones([2], (Kind::Float, Device::Cpu));
            c.all_reduce(&mut good, ReduceOp::Sum).unwrap();
            (shapes, kinds, ops, scatter.unwrap_err().to_string(), Vec::<f32>::try_from(&good).unwrap())
        });
        for (shapes, kinds, ops, scatter, good) in results {
            assert!(shapes.contains("rank 1 passed shape [3], rank 0 [2]"), "{shapes}");
            assert!(kinds.contains("rank 1 passed Double, rank 0 Float"), "{kinds}");
            assert!(ops.contains("rank 1 called Bytes(0), rank 0 Barrier"), "{ops}");
            assert!(scatter.contains("dimension 0 of [3] does not split into 2"), "{scatter}");
            assert_eq!(good, [2.0, 2.0]);
        }
    }

    #[test]
    fn a_rank_that_leaves_fails_every_other_rank_without_a_hang() {
        // Rank 2 leaves after one barrier; ranks 0 and 1 then fail in their next operation.
        let results = on_ranks(3, |c| {
            c.barrier().unwrap();
            if c.rank() == 2 {
                return (String::new(), String::new());
            }
            let first = c.barrier().unwrap_err().to_string();
            let after = c.barrier().unwrap_err().to_string();
            (first, after)
        });
        for (rank, (first, after)) in results.into_iter().enumerate().take(2) {
            assert!(first.contains("rank 2 left the group"), "rank {rank}: {first}");
            assert!(after.contains("rank 2 left the group"), "rank {rank}, later: {after}");
        }
        // Rank 0 leaving fails the others too.
        let results = on_ranks(2, |c| if c.rank() == 0 { String::new() } else { c.barrier().unwrap_err().to_string() });
        assert!(results[1].contains("rank 0 left the group"), "{}", results[1]);
    }

    #[test]
    fn a_rank_that_stops_answering_times_out() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let hub = listener.local_addr().unwrap();
        let quiet = std::thread::spawn(move || {
            let c = TcpCollective::connect(hub, 1, 2, "t", Duration::from_secs(5)).unwrap();
            std::thread::sleep(Duration::from_millis(1500));
            drop(c);
        });
        let c = TcpCollective::accept(&listener, 2, "t", Duration::from_millis(300)).unwrap();
        let error = c.barrier().unwrap_err().to_string();
        assert!(error.contains("rank 1 did not arrive in time"), "{error}");
        quiet.join().unwrap();
    }

    #[test]
    fn strangers_and_wrong_groups_are_refused_and_missing_ranks_reported() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let hub = listener.local_addr().unwrap();
        let joining = std::thread::spawn(move || {
            // A stray client, a rank of another group, a rank that thinks the group is
            // bigger: refused. Then the right rank 1 joins.
            let mut stray = TcpStream::connect(hub).unwrap();
            stray.write_all(b"GET / HTTP/1.1\r\nHost: keel\r\n\r\n").unwrap();
            let other = TcpCollective::connect(hub, 1, 2, "other", TIMEOUT).unwrap_err().to_string();
            let bigger = TcpCollective::connect(hub, 1, 3, "group", TIMEOUT).unwrap_err().to_string();
            let c = TcpCollective::connect(hub, 1, 2, "group", TIMEOUT).unwrap();
            c.barrier().unwrap();
            (other, bigger)
        });
        let c = TcpCollective::accept(&listener, 2, "group", TIMEOUT).unwrap();
        c.barrier().unwrap();
        let (other, bigger) = joining.join().unwrap();
        assert!(other.contains("belongs to another group"), "{other}");
        assert!(bigger.contains("thinks the group has 3 ranks, not 2"), "{bigger}");

        let alone = TcpListener::bind("127.0.0.1:0").unwrap();
        let error = TcpCollective::accept(&alone, 3, "g", Duration::from_millis(200)).unwrap_err().to_string();
        assert!(error.contains("ranks [1, 2] did not join"), "{error}");
        assert!(TcpCollective::connect(hub, 0, 2, "g", TIMEOUT).is_err(), "rank 0 does not connect");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ranks_find_rank_0_over_nats() {
        let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
        let client = async_nats::connect(url).await.expect("NATS at 127.0.0.1:4222 (or NATS_URL)");
        let subject = format!("keel.test.tcp.{}.{}", std::process::id(), uuid_like());
        let ip = local_ip_towards("127.0.0.1:4222").unwrap();
        let mut joins = Vec::new();
        for rank in [2usize, 0, 1] {
            let (client, subject) = (client.clone(), subject.clone());
            joins.push(tokio::spawn(async move {
                let c = TcpCollective::join(&client, &subject, rank, 3, ip, TIMEOUT).await.unwrap();
                tokio::task::spawn_blocking(move || {
                    let mut t = Tensor::from_slice(&[c.rank() as f32 + 1.0]);
                    c.all_reduce(&mut t, ReduceOp::Sum).unwrap();
                    Vec::<f32>::try_from(&t).unwrap()
                })
                .await
                .unwrap()
            }));
        }
        for join in joins {
            assert_eq!(join.await.unwrap(), [6.0]);
        }
    }

    fn uuid_like() -> u128 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
    }
}
