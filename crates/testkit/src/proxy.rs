//! A TCP proxy on loopback in front of a shard, for network faults the server process itself
//! cannot show: a partition (blackhole), a slow link (delay) and connection resets.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::server::DATABASE;

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    /// Forward everything at once.
    Pass,
    /// A partition: nothing is forwarded either way and new connections get no answer (bytes
    /// already sent wait, as in the kernel's buffers, and flow again when the mode changes).
    Blackhole,
    /// Every chunk waits this long before it is forwarded, both ways.
    Delay(Duration),
    /// Every open connection is reset (RST), and so is every new one.
    Reset,
    /// Requests reach the server, but the first reply (chunk) coming back is swallowed and
    /// the connection reset: the server acted and the client never hears of it. New
    /// connections fail the same way (their handshake is a reply).
    LoseReplies,
    /// The next reply only is swallowed (and its connection reset); then the proxy passes
    /// everything again: a client that retries on another connection gets through.
    LoseOneReply,
    /// Like [`ProxyMode::LoseOneReply`], but then the link is blackholed (until the mode is
    /// changed): a client's retry waits while the test acts on the shard.
    LoseOneReplyThenBlackhole,
    /// Like [`ProxyMode::LoseOneReply`], for the reply to the first request (chunk) that
    /// contains these bytes (a text statement such as `COMMIT`). The whole reply: of a request
    /// of several statements, the server's answers to the first ones are swallowed too, and the
    /// connection is reset only once the last statement answered, so that every statement of
    /// it ran (else the reset could stop the later ones, and a test of a reply lost after the
    /// server acted would find it had not).
    LoseReplyTo(&'static [u8]),
    /// Like [`ProxyMode::LoseReplyTo`], but then the link is blackholed (until the mode is
    /// changed), as [`ProxyMode::LoseOneReplyThenBlackhole`] does.
    LoseReplyToThenBlackhole(&'static [u8]),
    /// The first request (chunk) that contains these bytes is held back and its client's
    /// connection reset, while the proxy keeps that connection's server side open: the client
    /// gives up on a statement that is still on its way, as one stuck in a partition's
    /// retransmissions is. [`Proxy::held`] hands it to the test. Then the proxy passes
    /// everything.
    StrandTo(&'static [u8]),
    /// Like [`ProxyMode::StrandTo`], but then the link is blackholed (until the mode is
    /// changed), as [`ProxyMode::LoseOneReplyThenBlackhole`] does.
    StrandToThenBlackhole(&'static [u8]),
    /// The first request (chunk) that contains these bytes is held back, and its connection
    /// stays open both ways with nothing more forwarded: the client hears nothing until it
    /// gives up (its own timeout), with the statement still on its way. [`Proxy::held`] hands
    /// it to the test. Then the proxy passes everything.
    HoldTo(&'static [u8]),
    /// The first request (chunk) that contains these bytes waits on its connection, and the
    /// mode turns [`ProxyMode::Paused`]: the test knows the request was made, and lets it
    /// on (its reply comes back as usual) by setting any other mode. Every other connection
    /// passes meanwhile.
    PauseTo(&'static [u8]),
    /// A request [`ProxyMode::PauseTo`] caught waits; everything else passes.
    Paused,
    /// The next connection its client closes (a `COM_QUIT`, or the end of its stream) stays
    /// open on the server's side, as when the close is lost in a cut and the server keeps the
    /// session: [`Proxy::held`] hands that side to the test (with nothing to deliver). Then
    /// the proxy passes everything.
    HoldClose,
}

/// A request held back by [`ProxyMode::StrandTo`] or [`ProxyMode::HoldTo`], with its
/// connection's server side (and, for `HoldTo`, its client side, kept open until then).
#[derive(Debug)]
pub struct HeldRequest {
    request: Vec<u8>,
    thread: u32,
    server_read: OwnedReadHalf,
    server_write: OwnedWriteHalf,
    _client: Option<(OwnedReadHalf, OwnedWriteHalf)>,
}

impl HeldRequest {
    /// The server's thread id of the session it was meant for (from the server's greeting).
    pub fn thread(&self) -> u32 {
        self.thread
    }

    /// Sends it on, on the server connection it was meant for. Whether the server ran it:
    /// `true` when it answered (every statement of it), `false` when it had closed that
    /// session instead; panics when neither came within a minute. The server connection stays
    /// open while this lives: what the request did in its session (a transaction it opened, a
    /// lock it took) lasts as long as the session.
    pub async fn deliver(&mut self) -> bool {
        if self.server_write.write_all(&self.request).await.is_err() {
            return false;
        }
        // The whole reply: the later statements of a request of several run before it ends.
        // (A reply whose end is not recognised, or that never comes, fails the test after a
        // minute, rather than hang it or read as a closed session.)
        let (mut reply, mut chunk) = (Vec::new(), [0u8; 1024]);
        let whole = async {
            while !reply_complete(&reply) {
                match self.server_read.read(&mut chunk).await {
                    Ok(n) if n > 0 => reply.extend_from_slice(&chunk[..n]),
                    _ => return false,
                }
            }
            true
        };
        tokio::time::timeout(Duration::from_secs(60), whole)
            .await
            .expect("the held request's reply did not end within a minute")
    }
}

/// A proxy listening on its own loopback port and forwarding to `upstream`. Stops (resetting
/// its connections) when dropped.
#[derive(Debug)]
pub struct Proxy {
    port: u16,
    mode: watch::Sender<ProxyMode>,
    accept: JoinHandle<()>,
    held: tokio::sync::Mutex<mpsc::UnboundedReceiver<HeldRequest>>,
    /// Whether new connections' greetings name another thread than the server's session.
    renumber: Arc<AtomicBool>,
    /// Connections accepted so far.
    accepted: Arc<AtomicU64>,
}

impl Proxy {
    /// Starts a proxy to `127.0.0.1:upstream_port`, in [`ProxyMode::Pass`]. Needs a Tokio
    /// runtime; its tasks run there.
    pub async fn start(upstream_port: u16) -> io::Result<Self> {
        Self::start_to(SocketAddr::from(([127, 0, 0, 1], upstream_port))).await
    }

    /// [`Proxy::start`] to any `upstream` address (the proxy itself still listens on
    /// loopback).
    pub async fn start_to(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let (mode, _) = watch::channel(ProxyMode::Pass);
        let modes = mode.clone();
        let (hold, held) = mpsc::unbounded_channel();
        let renumber = Arc::new(AtomicBool::new(false));
        let renumbered = renumber.clone();
        let accepted = Arc::new(AtomicU64::new(0));
        let counted = accepted.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                let renumber = renumbered.load(Ordering::SeqCst);
                tokio::spawn(serve(
                    client,
                    upstream,
                    modes.clone(),
                    hold.clone(),
                    renumber,
                ));
            }
        });
        Ok(Self {
            port,
            mode,
            accept,
            held: tokio::sync::Mutex::new(held),
            renumber,
            accepted,
        })
    }

    /// How many connections the proxy accepted so far (in every mode: a blackholed one too).
    pub fn connections(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }

    /// From now on, the greeting of each new connection names another thread id than its
    /// server session's, as a proxy that keeps sessions of its own (ProxySQL) does: its
    /// clients cannot tell their server sessions apart from others.
    pub fn renumber_sessions(&self) {
        self.renumber.store(true, Ordering::SeqCst);
    }

    /// The next request [`ProxyMode::StrandTo`] or [`ProxyMode::HoldTo`] holds back (or the
    /// server side [`ProxyMode::HoldClose`] keeps), once it does. Panics when none is within
    /// a minute: the test's request never came, and it would wait for ever.
    pub async fn held(&self) -> HeldRequest {
        let next = async { self.held.lock().await.recv().await };
        tokio::time::timeout(Duration::from_secs(60), next)
            .await
            .expect("nothing was held back within a minute")
            .expect("the proxy runs while it is borrowed")
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `mysql://root@127.0.0.1:PORT/shardlock?prefer_socket=false` through the proxy. (On
    /// loopback the MySQL driver otherwise switches to the server's Unix socket after
    /// connecting, which would bypass the proxy.)
    pub fn url(&self) -> String {
        format!(
            "mysql://root@127.0.0.1:{}/{DATABASE}?prefer_socket=false",
            self.port
        )
    }

    /// Switches the mode; open connections follow at once.
    pub fn set(&self, mode: ProxyMode) {
        self.mode.send_replace(mode);
    }

    /// The mode in force.
    pub fn mode(&self) -> ProxyMode {
        *self.mode.borrow()
    }

    /// Waits until the mode is `mode` (set by the test, or by the proxy itself after a
    /// [`ProxyMode::LoseOneReply`] or [`ProxyMode::LoseOneReplyThenBlackhole`]).
    pub async fn wait_for(&self, mode: ProxyMode) {
        let _ = self.mode.subscribe().wait_for(|m| *m == mode).await;
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        // Connection tasks see the mode channel close and reset their sockets.
        self.mode.send_replace(ProxyMode::Reset);
    }
}

/// One client connection: connect upstream once the link is not blackholed, then pump both
/// ways until either side closes or the mode says reset.
async fn serve(
    client: TcpStream,
    upstream: SocketAddr,
    modes: watch::Sender<ProxyMode>,
    hold: mpsc::UnboundedSender<HeldRequest>,
    renumber: bool,
) {
    let mut mode = modes.subscribe();
    // Set when a request this connection forwarded matched `LoseReplyTo`.
    let armed = std::sync::atomic::AtomicBool::new(false);
    // A request this connection's client sent that `StrandTo` or `HoldTo` held back, and
    // whether its client side stays open (`HoldTo`).
    let held = std::sync::Mutex::new(None);
    // The server's thread id of the session, read off its greeting.
    let thread = std::sync::atomic::AtomicU32::new(0);
    // Closing with SO_LINGER 0 sends RST: what a reset means, and harmless otherwise. (Tokio
    // deprecates SO_LINGER because a non-zero linger blocks the thread on drop; zero does not.)
    #[allow(deprecated)]
    let _ = client.set_linger(Some(Duration::ZERO));
    if passable(&mut mode).await.is_none() {
        return;
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        return; // the shard is down: the client sees the connection close
    };
    #[allow(deprecated)]
    let _ = server.set_linger(Some(Duration::ZERO));
    let _ = (client.set_nodelay(true), server.set_nodelay(true));
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let requests = Direction::Requests {
        modes: &modes,
        held: &held,
    };
    tokio::select! {
        _ = pump(&mut client_read, &mut server_write, mode.clone(), requests, &armed) => {}
        _ = pump(&mut server_read, &mut client_write, mode, Direction::Replies { modes: &modes, thread: &thread, renumber }, &armed) => {}
    }
    let request = held.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some((request, keep_client)) = request {
        // The client's side is reset as this returns (for `HoldTo`, once the request is
        // delivered or dropped); the server's waits for `deliver`.
        let _ = hold.send(HeldRequest {
            request,
            thread: thread.into_inner(),
            server_read,
            server_write,
            _client: keep_client.then_some((client_read, client_write)),
        });
    }
}

/// Which way a [`pump`] forwards, and what it needs for that.
#[derive(Clone, Copy)]
enum Direction<'a> {
    /// Client to server: the proxy's mode, to end a `StrandTo` or `HoldTo`, and where its
    /// request is held (with whether its client side stays open).
    Requests {
        modes: &'a watch::Sender<ProxyMode>,
        held: &'a std::sync::Mutex<Option<(Vec<u8>, bool)>>,
    },
    /// Server to client: the proxy's mode, to end a `LoseOneReply`, and where the session's
    /// thread id goes once the server's greeting names it.
    Replies {
        modes: &'a watch::Sender<ProxyMode>,
        thread: &'a std::sync::atomic::AtomicU32,
        /// Whether the greeting is to name another thread (see [`Proxy::renumber_sessions`]).
        renumber: bool,
    },
}

/// The connection id a server's greeting (protocol 10: a packet header, the version byte, the
/// server's version ending in NUL, then the id) names, and where it is in `chunk`; `None` for
/// any other chunk.
fn greeting_thread(chunk: &[u8]) -> Option<(u32, usize)> {
    if chunk.get(4) != Some(&10) {
        return None;
    }
    let at = 5 + chunk.get(5..)?.iter().position(|&b| b == 0)? + 1;
    let id = chunk.get(at..at + 4)?;
    Some((u32::from_le_bytes(id.try_into().ok()?), at))
}

/// Whether `reply`, the bytes a server sent since a request, is that request's whole reply:
/// it ends with a whole packet that ends a reply, an error, or an OK (or EOF) packet whose
/// status does not say that more results follow (a request of several statements is answered
/// statement by statement). A reply cut inside a packet, or ending with a row or a column of a
/// result set, is not whole yet.
fn reply_complete(reply: &[u8]) -> bool {
    const MORE_RESULTS_EXIST: u16 = 0x0008;
    let mut at = 0;
    let mut last = None;
    while let Some(header) = reply.get(at..at + 4) {
        let len = u32::from_le_bytes([header[0], header[1], header[2], 0]) as usize;
        let Some(payload) = reply.get(at + 4..at + 4 + len) else {
            return false;
        };
        last = Some(payload);
        at += 4 + len;
    }
    if at != reply.len() {
        return false;
    }
    let status = |flags: Option<&[u8]>| {
        flags.is_some_and(|s| u16::from_le_bytes([s[0], s[1]]) & MORE_RESULTS_EXIST == 0)
    };
    // The length of a length-encoded integer at the start of `rest`.
    let skip = |rest: &[u8]| -> Option<usize> {
        Some(match *rest.first()? {
            0xfc => 3,
            0xfd => 4,
            0xfe => 9,
            _ => 1,
        })
    };
    match last {
        Some([0xff, ..]) => true,
        // An EOF packet: 0xfe, warnings, status flags.
        Some([0xfe, rest @ ..]) if rest.len() < 8 => status(rest.get(2..4)),
        // An OK packet (0xfe ends a result set so): affected rows and last insert id
        // (length-encoded), status flags.
        Some([0x00 | 0xfe, rest @ ..]) => {
            let Some(first) = skip(rest) else {
                return false;
            };
            let Some(second) = rest.get(first..).and_then(skip) else {
                return false;
            };
            status(rest.get(first + second..first + second + 2))
        }
        _ => false,
    }
}

/// Forwards chunks from `from` to `to` as the mode allows; returns when either side closes or
/// on reset.
async fn pump(
    from: &mut OwnedReadHalf,
    to: &mut OwnedWriteHalf,
    mut mode: watch::Receiver<ProxyMode>,
    direction: Direction<'_>,
    armed: &std::sync::atomic::AtomicBool,
) -> Option<()> {
    use std::sync::atomic::Ordering::SeqCst;
    let mut buf = vec![0u8; 16 * 1024];
    // The reply a `LoseReplyTo` swallows, so far.
    let mut swallowed = Vec::new();
    loop {
        passable(&mut mode).await?;
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) => {
                    if let Direction::Requests { modes, held } = direction {
                        hold_close(modes, held);
                    }
                    return None;
                }
                Err(_) => return None,
                Ok(n) => n,
            },
            // Re-check the mode before reading further (a blackhole stops reading).
            changed = mode.changed() => { changed.ok()?; continue; }
        };
        let lose = *mode.borrow();
        let contains = |pattern: &[u8]| buf[..n].windows(pattern.len()).any(|w| w == pattern);
        // A `COM_QUIT` (a packet of one byte, sequence 0, command 1) closes as the end of the
        // stream does.
        if lose == ProxyMode::HoldClose && buf[..n] == [1, 0, 0, 0, 1] {
            if let Direction::Requests { modes, held } = direction {
                hold_close(modes, held);
                return None;
            }
        }
        match direction {
            Direction::Requests { modes, held } => {
                if let ProxyMode::LoseReplyTo(pattern)
                | ProxyMode::LoseReplyToThenBlackhole(pattern) = lose
                {
                    if contains(pattern) {
                        armed.store(true, SeqCst);
                    }
                }
                if let ProxyMode::StrandTo(pattern)
                | ProxyMode::StrandToThenBlackhole(pattern)
                | ProxyMode::HoldTo(pattern) = lose
                {
                    if contains(pattern)
                        && modes.send_if_modified(|m| {
                            let first = *m == lose;
                            if first {
                                *m = match lose {
                                    ProxyMode::StrandToThenBlackhole(_) => ProxyMode::Blackhole,
                                    _ => ProxyMode::Pass,
                                };
                            }
                            first
                        })
                    {
                        let keep_client = matches!(lose, ProxyMode::HoldTo(_));
                        *held.lock().unwrap_or_else(|e| e.into_inner()) =
                            Some((buf[..n].to_vec(), keep_client));
                        return None;
                    }
                }
                if let ProxyMode::PauseTo(pattern) = lose {
                    if contains(pattern)
                        && modes.send_if_modified(|m| {
                            let first = *m == lose;
                            if first {
                                *m = ProxyMode::Paused;
                            }
                            first
                        })
                    {
                        mode.wait_for(|m| *m != ProxyMode::Paused).await.ok()?;
                    }
                }
            }
            Direction::Replies {
                modes,
                thread,
                renumber,
            } => {
                if thread.load(SeqCst) == 0 {
                    if let Some((id, at)) = greeting_thread(&buf[..n]) {
                        thread.store(id, SeqCst);
                        if renumber {
                            let other = id.wrapping_add(1_000_000);
                            buf[at..at + 4].copy_from_slice(&other.to_le_bytes());
                        }
                    }
                }
                if lose == ProxyMode::LoseReplies {
                    return None; // swallowed; the connection is reset
                }
                let one = matches!(
                    lose,
                    ProxyMode::LoseOneReply | ProxyMode::LoseOneReplyThenBlackhole
                ) || (matches!(
                    lose,
                    ProxyMode::LoseReplyTo(_) | ProxyMode::LoseReplyToThenBlackhole(_)
                ) && armed.load(SeqCst));
                if one
                    && matches!(
                        lose,
                        ProxyMode::LoseReplyTo(_) | ProxyMode::LoseReplyToThenBlackhole(_)
                    )
                {
                    swallowed.extend_from_slice(&buf[..n]);
                    if !reply_complete(&swallowed) {
                        continue; // swallowed; the rest of the reply is lost with it
                    }
                }
                if one
                    && modes.send_if_modified(|m| {
                        let first = *m == lose;
                        if first {
                            *m = match lose {
                                ProxyMode::LoseOneReplyThenBlackhole
                                | ProxyMode::LoseReplyToThenBlackhole(_) => ProxyMode::Blackhole,
                                _ => ProxyMode::Pass,
                            };
                        }
                        first
                    })
                {
                    return None;
                }
            }
        }
        let delay = passable(&mut mode).await?;
        if !delay.is_zero() {
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = mode.wait_for(|m| *m == ProxyMode::Reset) => return None,
            }
            passable(&mut mode).await?;
        }
        to.write_all(&buf[..n]).await.ok()?;
    }
}

/// A client's close under [`ProxyMode::HoldClose`], the first one: its connection's server
/// side is held (with nothing to deliver), and the proxy passes everything from now on.
fn hold_close(modes: &watch::Sender<ProxyMode>, held: &std::sync::Mutex<Option<(Vec<u8>, bool)>>) {
    let first = modes.send_if_modified(|m| {
        let hold = *m == ProxyMode::HoldClose;
        if hold {
            *m = ProxyMode::Pass;
        }
        hold
    });
    if first {
        *held.lock().unwrap_or_else(|e| e.into_inner()) = Some((Vec::new(), false));
    }
}

/// Waits while the link is blackholed; `None` on reset (or when the proxy is gone), else the
/// delay in force.
async fn passable(mode: &mut watch::Receiver<ProxyMode>) -> Option<Duration> {
    let current = *mode.wait_for(|m| *m != ProxyMode::Blackhole).await.ok()?;
    match current {
        ProxyMode::Reset | ProxyMode::Blackhole => None,
        ProxyMode::Pass
        | ProxyMode::LoseReplies
        | ProxyMode::LoseOneReply
        | ProxyMode::LoseOneReplyThenBlackhole
        | ProxyMode::LoseReplyTo(_)
        | ProxyMode::LoseReplyToThenBlackhole(_)
        | ProxyMode::StrandTo(_)
        | ProxyMode::StrandToThenBlackhole(_)
        | ProxyMode::HoldTo(_)
        | ProxyMode::PauseTo(_)
        | ProxyMode::Paused
        | ProxyMode::HoldClose => Some(Duration::ZERO),
        ProxyMode::Delay(d) => Some(d),
    }
}

#[cfg(test)]
mod tests {
    use super::reply_complete;

    /// A packet of sequence 1 carrying `payload`.
    fn packet(payload: &[u8]) -> Vec<u8> {
        let mut packet = vec![payload.len() as u8, 0, 0, 1];
        packet.extend_from_slice(payload);
        packet
    }

    /// An OK packet headed `head` with these status flags and a `0xfc` length-encoded
    /// affected-rows count.
    fn ok(head: u8, status: u16) -> Vec<u8> {
        let mut payload = vec![head, 0xfc, 0x2c, 0x01, 0x00];
        payload.extend_from_slice(&status.to_le_bytes());
        payload.extend_from_slice(&[0, 0]);
        packet(&payload)
    }

    #[test]
    fn a_reply_is_whole_once_no_more_results_follow() {
        let (more, last) = (ok(0x00, 0x0008 | 0x0002), ok(0x00, 0x0002));
        assert!(!reply_complete(&more));
        assert!(reply_complete(&last));
        assert!(reply_complete(&[more.clone(), last.clone()].concat()));
        assert!(!reply_complete(&[last.clone(), more.clone()].concat()));
        let whole = [more, last].concat();
        assert!(!reply_complete(&whole[..whole.len() - 1]), "a cut packet");
        assert!(!reply_complete(&[]));
        assert!(reply_complete(&packet(&[0xff, 0x28, 0x04])), "an error");

        // A result set: its column count, a column, a row, then an OK headed 0xfe (or an
        // EOF packet, from a server of the older protocol).
        let column = packet(&[3, b'd', b'e', b'f', 0, 0, 0, 1, b'n', 0, 0x0c]);
        let rows = [packet(&[1]), column, packet(&[1, b'7'])].concat();
        assert!(!reply_complete(&rows));
        assert!(reply_complete(&[rows.clone(), ok(0xfe, 0x0002)].concat()));
        let eof = |status: u16| packet(&[&[0xfe, 0, 0][..], &status.to_le_bytes()].concat());
        assert!(reply_complete(&[rows.clone(), eof(0x0002)].concat()));
        assert!(!reply_complete(&[rows, eof(0x000a)].concat()));
    }
}
