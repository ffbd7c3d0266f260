//! Upgrades without dropping a connection (ADR 0027): a new process takes the listening sockets
//! over from the running one, through a unix socket (`upgrade_socket`), as nginx and pingora do.
//!
//! 1. The running gateway listens on `upgrade_socket` (mode 0600: only its user may take its
//!    sockets) while it serves ([`offer`]).
//! 2. A new process started with the same configuration connects there first ([`take_over`]) and
//!    receives the S3, admin and alias endpoints' listening sockets (`SCM_RIGHTS`): the very sockets, with the
//!    connections the kernel has queued on them, so no connection is refused in between.
//! 3. Once it serves on them, it says so ([`Inherited::serving`]); the old process then stops
//!    accepting, answers each kept-alive connection's next request with `Connection: close`,
//!    finishes what it has in flight (downloads and uploads included, within
//!    `shutdown_grace_secs`), and then waits, holding no socket, for SIGTERM to exit (as nginx's
//!    old master does: a supervisor that restarted an exited process would take the sockets
//!    back). `/readyz` stays ready throughout: the node never stops serving.
//! 4. The new process then offers the sockets in turn at the same path.
//!
//! A new process that fails before it serves changes nothing: the old one keeps serving and
//! offering. Without a predecessor at the path, a process binds its addresses as usual.

use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

/// How long a new process waits for the running gateway to send its sockets.
const HAND_OVER_WAIT: Duration = Duration::from_secs(30);

/// Refuses a peer process that runs as another user (the socket's mode already keeps others out;
/// this holds if it was widened).
fn same_user(stream: &UnixStream) -> std::io::Result<()> {
    let peer = rustix::net::sockopt::socket_peercred(stream)?;
    if peer.uid == rustix::process::getuid() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!("the peer process runs as uid {}", peer.uid.as_raw())))
    }
}

/// What a successor sends once it serves on the sockets it took.
const SERVING: &[u8] = b"serving\n";

/// How long a predecessor waits for its successor to serve (a start loads the configuration,
/// the models' manifests and ONNX Runtime; seconds).
pub(crate) const SUCCESSOR_START_WAIT: Duration = Duration::from_secs(120);

/// Why an upgrade could not proceed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum UpgradeError {
    #[error("upgrade socket {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("upgrade socket {path}: the running gateway sent {got} sockets, not 2 to {MAX_SOCKETS}")]
    Sockets { path: PathBuf, got: usize },
}

/// Most listening sockets handed over: the S3 and admin ports and each alias endpoint's.
const MAX_SOCKETS: usize = 2 + crate::config::MAX_ALIAS_ENDPOINTS;

/// The listening sockets a new process took from the running one.
#[derive(Debug)]
pub(crate) struct Inherited {
    pub(crate) s3: std::net::TcpListener,
    pub(crate) admin: std::net::TcpListener,
    /// The alias endpoints' (`[[pushdown.alias_endpoints]]`), in the running gateway's order.
    pub(crate) aliases: Vec<std::net::TcpListener>,
}

/// The line back to the process the sockets came from.
#[derive(Debug)]
pub(crate) struct Predecessor(UnixStream);

impl Predecessor {
    /// Tells the predecessor that this process serves: it stops accepting and drains.
    ///
    /// # Errors
    /// The predecessor is gone (it stopped on its own; nothing more to do).
    pub(crate) fn serving(mut self) -> std::io::Result<()> {
        self.0.write_all(SERVING)
    }
}

/// At start, before binding: takes the listening sockets over from a gateway offering them at
/// `path`; `None` when none does (no socket there, or a stale one nobody listens on). Blocking.
///
/// # Errors
/// A gateway answered but the hand-over failed.
pub(crate) fn take_over(path: &Path) -> Result<Option<(Inherited, Predecessor)>, UpgradeError> {
    let io = |source| UpgradeError::Io { path: path.to_owned(), source };
    let predecessor = match UnixStream::connect(path) {
        Ok(s) => s,
        Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused) => {
            return Ok(None);
        }
        Err(e) => return Err(io(e)),
    };
    same_user(&predecessor).map_err(io)?;
    // A gateway that does not send its sockets (stuck, or handing them to another process) must
    // not hold this start forever.
    predecessor.set_read_timeout(Some(HAND_OVER_WAIT)).map_err(io)?;
    let mut byte = [0u8; 1];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_SOCKETS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    rustix::net::recvmsg(&predecessor, &mut [IoSliceMut::new(&mut byte)], &mut control, RecvFlags::CMSG_CLOEXEC)
        .map_err(|e| io(e.into()))?;
    let mut fds: Vec<OwnedFd> = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = message {
            fds.extend(rights);
        }
    }
    let got = fds.len();
    if !(2..=MAX_SOCKETS).contains(&got) {
        return Err(UpgradeError::Sockets { path: path.to_owned(), got });
    }
    let mut listeners = fds.into_iter().map(std::net::TcpListener::from);
    let (Some(s3), Some(admin)) = (listeners.next(), listeners.next()) else {
        return Err(UpgradeError::Sockets { path: path.to_owned(), got });
    };
    let inherited = Inherited { s3, admin, aliases: listeners.collect() };
    for l in [&inherited.s3, &inherited.admin].into_iter().chain(&inherited.aliases) {
        l.set_nonblocking(true).map_err(io)?;
    }
    Ok(Some((inherited, Predecessor(predecessor))))
}

/// The running gateway's side: offers its listening sockets (`sockets`: the S3 port's, the admin
/// port's, then each alias endpoint's) at `path` until a
/// successor serves on them, then returns (the caller hands over: stops accepting and drains).
/// A successor that disconnects or does not serve within [`SUCCESSOR_START_WAIT`] changes
/// nothing: the offer stands for the next one.
///
/// # Errors
/// The socket cannot be bound at `path`.
pub(crate) async fn offer(path: PathBuf, sockets: Vec<OwnedFd>) -> Result<(), UpgradeError> {
    let io = |source| UpgradeError::Io { path: path.clone(), source };
    // A stale socket of an earlier process (its successor, this process, replaced it).
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(e)),
        _ => {}
    }
    // Created 0600 (the process's umask for the call), not narrowed after: no other user may
    // connect in between and take the sockets.
    let umask = rustix::process::umask(rustix::fs::Mode::from_bits_truncate(0o077));
    let bound = tokio::net::UnixListener::bind(&path);
    rustix::process::umask(umask);
    let listener = bound.map_err(io)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    let fds = std::sync::Arc::new(sockets);
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "Upgrade socket: accept failed.");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let fds = fds.clone();
        let handed = tokio::task::spawn_blocking(move || hand(stream, &fds)).await;
        match handed {
            Ok(Ok(())) => {
                tracing::info!("Upgrade: the new process serves; handing over.");
                return Ok(());
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "Upgrade: the new process did not take over; serving on."),
            Err(e) => tracing::warn!(error = %e, "Upgrade: hand-over failed; serving on."),
        }
    }
}

/// Sends the sockets to a successor and waits for it to serve. Blocking.
fn hand(stream: tokio::net::UnixStream, sockets: &[OwnedFd]) -> std::io::Result<()> {
    let mut stream = stream.into_std()?;
    stream.set_nonblocking(false)?;
    same_user(&stream)?;
    let fds: Vec<_> = sockets.iter().map(AsFd::as_fd).collect();
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_SOCKETS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other("no room for the sockets"));
    }
    rustix::net::sendmsg(&stream, &[IoSlice::new(b"s")], &mut control, SendFlags::empty())?;
    stream.set_read_timeout(Some(SUCCESSOR_START_WAIT))?;
    let mut said = [0u8; SERVING.len()];
    stream.read_exact(&mut said)?;
    if said == SERVING { Ok(()) } else { Err(std::io::Error::other("unexpected message")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_listening_socket_is_handed_over_in_order() {
        let dir = std::env::temp_dir().join(format!("tg-upgrade-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("upgrade.sock");
        // The S3 port, the admin port and two alias endpoints.
        let listeners: Vec<_> = (0..4).map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind")).collect();
        let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().expect("addr")).collect();
        let fds = listeners.iter().map(|l| l.as_fd().try_clone_to_owned().expect("dup")).collect();
        let offered = tokio::spawn(offer(path.clone(), fds));
        let taken = loop {
            let p = path.clone();
            match tokio::task::spawn_blocking(move || take_over(&p)).await.expect("join").expect("hand-over") {
                Some(t) => break t,
                None => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        let (inherited, predecessor) = taken;
        let got: Vec<_> = [&inherited.s3, &inherited.admin]
            .into_iter()
            .chain(&inherited.aliases)
            .map(|l| l.local_addr().expect("addr"))
            .collect();
        assert_eq!(got, addrs);
        tokio::task::spawn_blocking(move || predecessor.serving()).await.expect("join").expect("told");
        offered.await.expect("join").expect("the offer ends once the successor serves");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
