//! Who a request comes from, for the conversation cache's anonymous scope
//! (`tandem_edge::conversation::Who`): anonymous requests reuse each other's
//! kept state only within one identity, so one client never learns how much of
//! its prompt another client's cached one shares (nor evicts it).
//!
//! 1. With an API key, the key's holders are one identity (`"api-key"`).
//! 2. Without one (serve-edge then listens on loopback only), the client is
//!    the OS user owning the client's end of the TCP connection, read from
//!    `/proc/net/tcp` or `/proc/net/tcp6` (Linux): `"uid:<n>"`. Processes of
//!    one user could read each other's memory anyway, so sharing between them
//!    tells nothing new; two users of one machine never share.
//! 3. Otherwise (no key and no owner found: another OS, a vanished socket)
//!    anonymous requests neither find nor leave state.

use axum::extract::connect_info::Connected;
use axum::serve::IncomingStream;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use tokio::net::TcpListener;

/// Both ends of a client's connection, as the server's end sees them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientAddrs {
    /// The client's address and port.
    pub peer: SocketAddr,
    /// The server's address and port on this connection.
    pub local: SocketAddr,
}

impl Connected<IncomingStream<'_, TcpListener>> for ClientAddrs {
    fn connect_info(stream: IncomingStream<'_, TcpListener>) -> Self {
        let peer = *stream.remote_addr();
        // The accepted socket's own address (exact even when listening on
        // 0.0.0.0); the peer's port stands in if the OS cannot say.
        let local = stream.io().local_addr().unwrap_or(peer);
        Self { peer, local }
    }
}

/// The anonymous scope of a request: see the module doc.
pub fn anonymous_scope(api_key: bool, addrs: Option<ClientAddrs>) -> Option<String> {
    if api_key {
        return Some("api-key".to_owned());
    }
    let a = addrs?;
    if !a.peer.ip().is_loopback() {
        return None;
    }
    socket_owner_uid(a).map(|uid| format!("uid:{uid}"))
}

/// The uid owning the client's end of the connection `a` (Linux).
#[cfg(target_os = "linux")]
fn socket_owner_uid(a: ClientAddrs) -> Option<u32> {
    let table = match a.peer {
        SocketAddr::V4(_) => "/proc/net/tcp",
        SocketAddr::V6(_) => "/proc/net/tcp6",
    };
    let text = std::fs::read_to_string(table).ok()?;
    owner_in_table(&text, a)
}

#[cfg(not(target_os = "linux"))]
fn socket_owner_uid(_a: ClientAddrs) -> Option<u32> {
    None
}

/// The uid of the row of a `/proc/net/tcp{,6}` table whose local address is
/// the client's and whose remote address is the server's end.
fn owner_in_table(text: &str, a: ClientAddrs) -> Option<u32> {
    text.lines().skip(1).find_map(|line| {
        let cols: Vec<&str> = line.split_whitespace().collect();
        let (local, remote, uid) = (cols.get(1)?, cols.get(2)?, cols.get(7)?);
        (parse_addr(local)? == a.peer && parse_addr(remote)? == a.local)
            .then(|| uid.parse().ok())
            .flatten()
    })
}

/// `0100007F:1F90` (IPv4, one 32-bit word in host byte order) or 32 hex
/// digits (IPv6, four such words), a colon and the port in hex.
fn parse_addr(s: &str) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        let hex = ip.get(i * 8..i * 8 + 8)?;
        Some(u32::from_str_radix(hex, 16).ok()?.to_ne_bytes())
    };
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(b))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex4(ip: Ipv4Addr) -> String {
        format!("{:08X}", u32::from_ne_bytes(ip.octets()))
    }

    #[test]
    fn addresses_of_the_proc_table_parse_in_host_byte_order() {
        let v4 = format!("{}:1F90", hex4(Ipv4Addr::LOCALHOST));
        assert_eq!(parse_addr(&v4), Some("127.0.0.1:8080".parse().unwrap()));
        let one = format!("{:08X}", u32::from_ne_bytes([0, 0, 0, 1]));
        let v6 = format!("{}{}{}{}:0050", "00000000", "00000000", "00000000", one);
        assert_eq!(parse_addr(&v6), Some("[::1]:80".parse().unwrap()));
        for bad in [
            "",
            "7F",
            "0100007F",
            "0100007F:xyz",
            "0100007:1F90",
            "zz00007F:0001",
        ] {
            assert_eq!(parse_addr(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_owner_is_the_row_of_the_client_end() {
        let lo = hex4(Ipv4Addr::LOCALHOST);
        let table = format!(
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
             0: {lo}:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0\n\
             1: {lo}:1F90 {lo}:D431 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0\n\
             2: {lo}:D431 {lo}:1F90 01 00000000:00000000 00:00000000 00000000  1000        0 3 1 0\n"
        );
        let a = ClientAddrs {
            peer: "127.0.0.1:54321".parse().unwrap(),
            local: "127.0.0.1:8080".parse().unwrap(),
        };
        assert_eq!(owner_in_table(&table, a), Some(1000));
        let other = ClientAddrs {
            peer: "127.0.0.1:54322".parse().unwrap(),
            ..a
        };
        assert_eq!(owner_in_table(&table, other), None);
    }

    #[test]
    fn a_key_is_one_identity_and_remote_clients_without_one_are_nobody() {
        assert_eq!(anonymous_scope(true, None).as_deref(), Some("api-key"));
        assert_eq!(anonymous_scope(false, None), None);
        let remote = ClientAddrs {
            peer: "10.0.0.2:40000".parse().unwrap(),
            local: "10.0.0.1:8080".parse().unwrap(),
        };
        assert_eq!(anonymous_scope(false, Some(remote)), None);
    }

    /// A real loopback connection of this process: its owner is this
    /// process's uid.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_loopback_client_of_this_process_is_this_user() {
        let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(server.local_addr().unwrap()).unwrap();
        let (_conn, peer) = server.accept().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        let a = ClientAddrs {
            peer,
            local: server.local_addr().unwrap(),
        };
        let uid = std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().next().map(str::to_owned))
            .unwrap();
        assert_eq!(anonymous_scope(false, Some(a)), Some(format!("uid:{uid}")));
    }
}
