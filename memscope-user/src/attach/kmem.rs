//! The kernel memory the tracer's BPF maps hold, map by map, as the kernel charges it
//! (`memlock:` in `/proc/self/fdinfo/FD`): the daemon's other half of its own cost, beside its
//! resident memory. Read from fdinfo because aya has no accessor for it, and from our own
//! descriptors because looking a map up by id needs CAP_SYS_ADMIN, which the daemon does not keep.

use std::os::fd::{AsFd as _, AsRawFd as _};

use aya::maps::{Map, MapData};
use aya::Ebpf;

/// The map's data, for the kinds of map the eBPF object has.
fn data(map: &Map) -> Option<&MapData> {
    match map {
        Map::Array(m)
        | Map::HashMap(m)
        | Map::LruHashMap(m)
        | Map::PerCpuArray(m)
        | Map::PerCpuHashMap(m)
        | Map::RingBuf(m)
        | Map::StackTraceMap(m) => Some(m),
        _ => None,
    }
}

/// `memlock:` of one descriptor's fdinfo text.
fn memlock(fdinfo: &str) -> Option<u64> {
    fdinfo.lines().find_map(|l| l.strip_prefix("memlock:")?.trim().parse().ok())
}

/// Bytes of kernel memory charged to each map, by name, largest first.
pub fn map_memory(ebpf: &Ebpf) -> Vec<(String, u64)> {
    let mut maps: Vec<(String, u64)> = ebpf
        .maps()
        .filter_map(|(name, map)| {
            let fd = data(map)?.fd().as_fd().as_raw_fd();
            let text = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
            Some((name.to_owned(), memlock(&text)?))
        })
        .collect();
    maps.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    maps
}

#[cfg(test)]
mod tests {
    use super::memlock;

    #[test]
    fn memlock_is_read_from_a_maps_fdinfo() {
        let text = "pos:\t0\nflags:\t02000002\nmnt_id:\t16\nino:\t1049\nmap_type:\t9\nkey_size:\t16\n\
                    value_size:\t24\nmax_entries:\t1048576\nmap_flags:\t0x2\nmap_extra:\t0x0\n\
                    memlock:\t109051904\nmap_id:\t17\nfrozen:\t0\n";
        assert_eq!(memlock(text), Some(109_051_904));
        assert_eq!(memlock("pos:\t0\n"), None);
    }
}
