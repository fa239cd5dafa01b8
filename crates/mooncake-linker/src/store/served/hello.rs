//! The served store's hello: each side proves to the other that it holds the store's key
//! ([`StoreKey`]) without sending it.
//!
//! 1. The client sends 32 bytes: magic, protocol, its id, and a fresh random nonce.
//! 2. The server answers [`answer::PROVE`], a nonce of its own, and its proof: a hash of the
//!    key, the client's whole hello and the server's nonce ([`proof`], [`Role::Server`]). A peer of another protocol is
//!    answered [`answer::OTHER_PROTOCOL`] instead.
//! 3. The client checks the server's proof, and only then sends its own ([`Role::Client`]);
//!    a server that cannot prove the key gets nothing more.
//! 4. The server answers [`answer::ACCEPTED`] or [`answer::WRONG_KEY`].
//!
//! Why both ways: an abstract socket's name is listed to every user of the host, and once
//! the server's process is gone anyone may bind it. A client that sent its key at hello (as
//! protocol 6 did) would hand it, and then every put (other users' KV) to such a process,
//! and read whatever bytes it served, its checksum companions included. The proofs are bound
//! to both nonces (and the client's id and protocol), so one seen on the wire proves nothing
//! on another connection.
//!
//! Not a secure channel: after the hello the bytes travel in the clear, and a peer on the path
//! of a TCP connection could read or relay them. `tcp:` addresses are for networks whose
//! hosts the deployment trusts.

use std::io::{self, Read};

use sha2::{Digest, Sha256};

use super::protocol::{Enc, StoreKey, MAGIC, PROTOCOL};

/// Bytes of the client's hello (step 1).
pub(crate) const HELLO_LEN: usize = 32;
/// Bytes of a nonce.
pub(crate) const NONCE_LEN: usize = 16;
/// Bytes of a proof.
pub(crate) const PROOF_LEN: usize = 32;

/// The server's answers (a `u32` each).
pub(crate) mod answer {
    /// The client proved the key: requests may follow.
    pub(crate) const ACCEPTED: u32 = 0;
    /// The hello is of another protocol (nothing follows).
    pub(crate) const OTHER_PROTOCOL: u32 = 1;
    /// The client's proof did not match this server's key.
    pub(crate) const WRONG_KEY: u32 = 2;
    /// The server's nonce and proof follow; the client's proof is awaited.
    pub(crate) const PROVE: u32 = 3;
}

/// Which side a proof is of (so that one side's proof is never the other's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// The server's proof (step 2).
    Server,
    /// The client's proof (step 3).
    Client,
}

/// Client `client`'s hello (step 1): magic, protocol, its id, and a fresh nonce.
pub(crate) fn client_hello(client: u64) -> io::Result<[u8; HELLO_LEN]> {
    let mut head = Enc::default();
    head.u32(MAGIC).u32(PROTOCOL).u64(client);
    let mut said = [0u8; HELLO_LEN];
    said[..HELLO_LEN - NONCE_LEN].copy_from_slice(&head.0);
    said[HELLO_LEN - NONCE_LEN..].copy_from_slice(&nonce()?);
    Ok(said)
}

/// A fresh random nonce from the kernel's random source.
pub(crate) fn nonce() -> io::Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut n)?;
    Ok(n)
}

/// `role`'s proof that it holds `key`, for the connection whose client hello (step 1: magic,
/// protocol, client id, the client's nonce) is `hello` and whose server nonce is `server`:
/// SHA-256 over a fixed label, the role, the key, the hello and the server's nonce (every
/// part of a fixed length), so a proof also vouches for the hello's client id and protocol.
pub(crate) fn proof(
    role: Role,
    key: &StoreKey,
    hello: &[u8; HELLO_LEN],
    server: &[u8; NONCE_LEN],
) -> [u8; PROOF_LEN] {
    let mut h = Sha256::new();
    h.update(b"kvlink served store hello\0");
    h.update(match role {
        Role::Server => b"server",
        Role::Client => b"client",
    });
    h.update(key.0);
    h.update(hello);
    h.update(server);
    h.finalize().into()
}

/// Whether `got` is `want`, compared in time that does not depend on where they differ.
pub(crate) fn same_proof(got: &[u8; PROOF_LEN], want: &[u8; PROOF_LEN]) -> bool {
    got.iter().zip(want).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0
}

/// Both sides of the hello over a raw Unix socket, for tests that play a client or a server
/// by hand.
#[cfg(test)]
pub(crate) mod by_hand {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    use super::*;

    /// Says a client's hello (as client `client`, proving `key`) on `raw` and returns the
    /// server's last answer; panics when the server's proof does not match `key`.
    pub(crate) fn as_client(raw: &mut UnixStream, client: u64, key: &StoreKey) -> u32 {
        let hello = send_head(raw, client);
        finish_as_client(raw, key, &hello)
    }

    /// The client's first 32 bytes (its hello, with a fresh nonce), sent; returned.
    pub(crate) fn send_head(raw: &mut UnixStream, client: u64) -> [u8; HELLO_LEN] {
        let hello = client_hello(client).unwrap();
        raw.write_all(&hello).unwrap();
        hello
    }

    /// The rest of [`as_client`] once `hello` went out.
    pub(crate) fn finish_as_client(
        raw: &mut UnixStream,
        key: &StoreKey,
        hello: &[u8; HELLO_LEN],
    ) -> u32 {
        assert_eq!(read_u32(raw), answer::PROVE, "the server's proof follows");
        let mut theirs = [0u8; NONCE_LEN];
        let mut proved = [0u8; PROOF_LEN];
        raw.read_exact(&mut theirs).unwrap();
        raw.read_exact(&mut proved).unwrap();
        assert!(
            same_proof(&proved, &proof(Role::Server, key, hello, &theirs)),
            "the server proved the key"
        );
        raw.write_all(&proof(Role::Client, key, hello, &theirs))
            .unwrap();
        read_u32(raw)
    }

    /// Answers a client's hello on `c` as a server of the all-zero key (what a client of an
    /// address without a key proves): a test's fake server. The client's 32 bytes.
    pub(crate) fn as_server(c: &mut UnixStream) -> [u8; HELLO_LEN] {
        as_server_of(c, &StoreKey([0; 16]))
    }

    /// [`as_server`] with the key `key`. A client that found the proof wrong sends nothing
    /// more: the answer is then not written.
    pub(crate) fn as_server_of(c: &mut UnixStream, key: &StoreKey) -> [u8; HELLO_LEN] {
        let mut hello = [0u8; HELLO_LEN];
        c.read_exact(&mut hello).unwrap();
        let ours = nonce().unwrap();
        c.write_all(&answer::PROVE.to_le_bytes()).unwrap();
        c.write_all(&ours).unwrap();
        c.write_all(&proof(Role::Server, key, &hello, &ours))
            .unwrap();
        let mut proved = [0u8; PROOF_LEN];
        if c.read_exact(&mut proved).is_err() {
            return hello;
        }
        let verdict = if same_proof(&proved, &proof(Role::Client, key, &hello, &ours)) {
            answer::ACCEPTED
        } else {
            answer::WRONG_KEY
        };
        c.write_all(&verdict.to_le_bytes()).unwrap();
        hello
    }

    fn read_u32(raw: &mut UnixStream) -> u32 {
        let mut a = [0u8; 4];
        raw.read_exact(&mut a).unwrap();
        u32::from_le_bytes(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_is_bound_to_its_role_key_hello_and_nonce() {
        let key = StoreKey([7; 16]);
        let (c, s) = ([1; HELLO_LEN], [2; NONCE_LEN]);
        let p = proof(Role::Server, &key, &c, &s);
        assert!(same_proof(&p, &proof(Role::Server, &key, &c, &s)));
        let mut other_client = c;
        other_client[8] ^= 1;
        for other in [
            proof(Role::Client, &key, &c, &s),
            proof(Role::Server, &StoreKey([8; 16]), &c, &s),
            proof(Role::Server, &key, &[3; HELLO_LEN], &s),
            proof(Role::Server, &key, &other_client, &s),
            proof(Role::Server, &key, &c, &[3; NONCE_LEN]),
        ] {
            assert!(!same_proof(&p, &other));
        }
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }
}
