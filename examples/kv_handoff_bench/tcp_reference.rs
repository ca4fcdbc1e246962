//! The TCP reference, between the same two processes as ferry's requests:
//! the decode process sends the prefill process each piece's source (rank,
//! region, offset, length) on its stdin; the prefill process connects
//! [`CONNECTIONS`] sockets back and sends a contiguous share of the pieces
//! on each with `writev`, from its own regions, as ferry's owner does; the
//! decode process receives them with `readv` into its reference buffers.
//! Every byte crosses the kernel twice, between two processes, as in
//! ferry's; only ferry's requests and framing are missing.

use std::io::{self, BufRead, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use ferry::LocalLayout;

use super::reference::{CONNECTIONS, MemcpyReference, Piece, Side, vectored_all};

/// How long either process waits for the other.
const PATIENCE: Duration = Duration::from_secs(30);

/// A piece's source on the wire: rank and region (`u32`), offset and
/// length (`u64`), little-endian.
const SOURCE_BYTES: usize = 24;

/// GB/s receiving `pieces` from the prefill process, which reads the
/// request on its stdin (`child`), timed from the go on the connections to
/// the last byte.
pub fn receive(
    child: &mut impl Write,
    reference: &MemcpyReference,
    pieces: &[Piece],
) -> io::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    let mut request = format!("TCP {port} {}\n", pieces.len()).into_bytes();
    for piece in pieces {
        let (rank, region, offset) = reference.origin(piece);
        request.extend(rank.to_le_bytes());
        request.extend(region.to_le_bytes());
        request.extend(offset.to_le_bytes());
        request.extend((piece.len as u64).to_le_bytes());
    }
    child.write_all(&request)?;
    child.flush()?;
    let connections = accept(&listener)?;
    let total: usize = pieces.iter().map(|p| p.len).sum();
    let start = Instant::now();
    std::thread::scope(|scope| {
        let mut moving = Vec::new();
        for (stream, share) in connections.iter().zip(shares(pieces)) {
            moving.push(scope.spawn(move || {
                let mut go = stream;
                go.write_all(&[1])?;
                vectored_all(stream, share, Side::Receive)
            }));
        }
        moving
            .into_iter()
            .try_for_each(|t| t.join().expect("TCP reference thread"))
    })?;
    Ok(total as f64 / start.elapsed().as_secs_f64() / 1e9)
}

/// The prefill process's [`CONNECTIONS`] connections, in share order (each
/// says its share first), within [`PATIENCE`].
fn accept(listener: &TcpListener) -> io::Result<Vec<TcpStream>> {
    listener.set_nonblocking(true)?;
    let mut connections: Vec<Option<TcpStream>> = (0..CONNECTIONS).map(|_| None).collect();
    let waiting = Instant::now();
    let mut accepted = 0;
    while accepted < CONNECTIONS {
        match listener.accept() {
            Ok((mut stream, _)) => {
                stream.set_nonblocking(false)?;
                stream.set_read_timeout(Some(PATIENCE))?;
                let mut share = [0u8];
                stream.read_exact(&mut share)?;
                let slot = (connections.get_mut(share[0] as usize))
                    .filter(|slot| slot.is_none())
                    .ok_or_else(|| io::Error::other(format!("share {} twice", share[0])))?;
                *slot = Some(stream);
                accepted += 1;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if waiting.elapsed() > PATIENCE {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(connections.into_iter().flatten().collect())
}

/// `pieces` in [`CONNECTIONS`] contiguous shares, the last ones empty when
/// there are fewer pieces: both processes cut them the same way.
fn shares(pieces: &[Piece]) -> impl Iterator<Item = &[Piece]> {
    let share = pieces.len().div_ceil(CONNECTIONS).max(1);
    let at = move |i: usize| (i * share).min(pieces.len());
    (0..CONNECTIONS).map(move |i| &pieces[at(i)..at(i + 1)])
}

/// The prefill process's side: serves the decode process's requests from
/// `input` (its stdin) until it closes it, each a `TCP <port> <count>`
/// line and the pieces' sources, sent from `ranks`' regions (`ranks[r]`
/// is rank `r`).
pub fn serve(input: &mut impl BufRead, ranks: &[LocalLayout]) -> io::Result<()> {
    let mut line = String::new();
    loop {
        line.clear();
        if input.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        let ["TCP", port, count] = words[..] else {
            return Err(io::Error::other(format!("not a request: {line:?}")));
        };
        let port: u16 = port.parse().map_err(io::Error::other)?;
        let count: usize = count.parse().map_err(io::Error::other)?;
        let mut sources = vec![0u8; count * SOURCE_BYTES];
        input.read_exact(&mut sources)?;
        let pieces = (sources.chunks_exact(SOURCE_BYTES))
            .map(|source| piece(source, ranks))
            .collect::<io::Result<Vec<Piece>>>()?;
        send(port, &pieces)?;
    }
}

/// The piece a source names, checked against its region.
fn piece(source: &[u8], ranks: &[LocalLayout]) -> io::Result<Piece> {
    let u32_at = |i: usize| u32::from_le_bytes(source[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(source[i..i + 8].try_into().expect("8 bytes"));
    let (rank, region, offset, len) = (u32_at(0), u32_at(4), u64_at(8), u64_at(16));
    let region = (ranks.get(rank as usize))
        .and_then(|r| r.regions().get(region as usize))
        .ok_or_else(|| io::Error::other(format!("no region {region} of rank {rank}")))?;
    if offset.checked_add(len).is_none_or(|end| end > region.len()) {
        return Err(io::Error::other("a piece past its region"));
    }
    Ok(Piece {
        to: 0,
        from: region.memory().as_ptr() as usize + offset as usize,
        len: len as usize,
        source: (0, offset),
    })
}

/// Connects to the decode process on `port` and sends a share of `pieces`
/// on each connection, once it says go.
fn send(port: u16, pieces: &[Piece]) -> io::Result<()> {
    std::thread::scope(|scope| {
        let mut moving = Vec::new();
        for (i, share) in shares(pieces).enumerate() {
            moving.push(scope.spawn(move || {
                let mut stream = TcpStream::connect(("127.0.0.1", port))?;
                stream.set_read_timeout(Some(PATIENCE))?;
                stream.write_all(&[i as u8])?;
                stream.read_exact(&mut [0u8])?;
                vectored_all(&stream, share, Side::Send)
            }));
        }
        moving
            .into_iter()
            .try_for_each(|t| t.join().expect("TCP reference thread"))
    })
}
