//! The driver's own memory figures, read while tracing (the tracer's `driver` module asks the
//! management library): `ms_driver` rows, and the device's `free` and `total` on the output's
//! `START_TRACE` row, where msMemScope writes them (and where `ms_oom.capacity` reads the card's
//! size from).
//!
//! A reading can come before the first row of its device (the output is created on first use):
//! its rows wait here, a bounded number, and the first reading's free and total go onto the
//! `START_TRACE` row when the output is created. A reading that comes after the output was
//! created without them sets them on that row (one UPDATE, with the next commit).

use super::{DeviceKey, StoreError};

/// Rows kept for outputs not created yet; past it, the oldest go (a device the job never
/// allocates on would otherwise keep them all).
const PENDING_LIMIT: usize = 4096;

/// One device's figures for one traced process at one reading (or for the device alone, `pid`
/// `None`, when no traced process was on it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverRow {
    pub ts_ns: u64,
    pub device: DeviceKey,
    pub pid: Option<u32>,
    pub process_used: Option<u64>,
    pub device_used: Option<u64>,
    pub device_total: Option<u64>,
    /// `dcmi` or `nvml`.
    pub source: &'static str,
}

impl DriverRow {
    /// The device's (free, total) bytes, when the reading has both.
    pub fn free_total(&self) -> Option<(u64, u64)> {
        let (used, total) = (self.device_used?, self.device_total?);
        Some((total.saturating_sub(used), total))
    }
}

/// Created with our other tables ([`super::schema::OWN_TABLES`]).
pub const TABLE: &str = "ms_driver";

/// Readings for outputs not created yet, and each device's first free and total.
#[derive(Default)]
pub struct Pending {
    rows: Vec<DriverRow>,
    first: std::collections::BTreeMap<DeviceKey, (u64, u64)>,
}

impl Pending {
    /// Notes a row's free and total if it is its device's first; true when it is.
    pub fn note_first(&mut self, row: &DriverRow) -> bool {
        match row.free_total() {
            Some(ft) if !self.first.contains_key(&row.device) => {
                self.first.insert(row.device, ft);
                true
            }
            _ => false,
        }
    }

    pub fn first(&self, device: DeviceKey) -> Option<(u64, u64)> {
        self.first.get(&device).copied()
    }

    pub fn hold(&mut self, row: DriverRow) {
        if self.rows.len() >= PENDING_LIMIT {
            self.rows.remove(0);
        }
        self.rows.push(row);
    }

    /// The rows held for `device`, in order, removed.
    pub fn take(&mut self, device: DeviceKey) -> Vec<DriverRow> {
        let (mine, rest) = std::mem::take(&mut self.rows).into_iter().partition(|r| r.device == device);
        self.rows = rest;
        mine
    }
}

/// Inserts `rows` into an open DB's `ms_driver`.
pub fn insert(conn: &rusqlite::Connection, rows: &[DriverRow]) -> rusqlite::Result<()> {
    let as_i64 = |v: Option<u64>| v.map(|v| v.min(i64::MAX as u64) as i64);
    let mut stmt = conn.prepare_cached(
        "INSERT INTO ms_driver (ts_ns, pid, process_used, device_used, device_total, source) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?;
    for r in rows {
        stmt.execute(rusqlite::params![
            r.ts_ns as i64,
            r.pid,
            as_i64(r.process_used),
            as_i64(r.device_used),
            as_i64(r.device_total),
            r.source
        ])?;
    }
    Ok(())
}

/// Sets the device's free and total on the `START_TRACE` row (`id`), as strings like every Attr
/// value Insight reads. Found by rowid, which the writer makes the row's `ID`: `ID` has no index,
/// and a scan of a large table would read (and map) all of it.
pub fn set_start_memory(conn: &rusqlite::Connection, id: u64, (free, total): (u64, u64)) -> rusqlite::Result<()> {
    use crate::vocab::attr;
    let set = format!(
        "UPDATE {} SET Attr = json_set(Attr, '$.{}', ?1, '$.{}', ?2)",
        super::schema::DUMP_TABLE,
        attr::free,
        attr::total
    );
    let values = rusqlite::params![free.to_string(), total.to_string(), id as i64];
    let by_rowid = format!("{set} WHERE rowid = ?3 AND ID = ?3 AND Event = 'SYSTEM'");
    if conn.prepare_cached(&by_rowid)?.execute(values)? == 0 {
        conn.prepare_cached(&format!("{set} WHERE ID = ?3 AND Event = 'SYSTEM'"))?.execute(values)?;
    }
    Ok(())
}

/// For sinks that keep no driver table (CSV).
pub fn ignored(_rows: &[DriverRow]) -> Result<(), StoreError> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(device: u32, ts: u64, used: Option<u64>) -> DriverRow {
        DriverRow {
            ts_ns: ts,
            device: DeviceKey::Npu(device),
            pid: Some(7),
            process_used: Some(5),
            device_used: used,
            device_total: Some(100),
            source: "dcmi",
        }
    }

    #[test]
    fn the_first_complete_reading_of_a_device_gives_its_free_and_total() {
        let mut p = Pending::default();
        assert!(!p.note_first(&row(0, 1, None)), "no used figure: nothing to say");
        assert!(p.note_first(&row(0, 2, Some(30))));
        assert!(!p.note_first(&row(0, 3, Some(40))), "only the first");
        assert_eq!(p.first(DeviceKey::Npu(0)), Some((70, 100)));
        assert_eq!(p.first(DeviceKey::Npu(1)), None);
    }

    #[test]
    fn held_rows_come_back_per_device_in_order_and_are_bounded() {
        let mut p = Pending::default();
        for ts in 0..(PENDING_LIMIT as u64 + 2) {
            p.hold(row((ts % 2) as u32, ts, None));
        }
        let zero = p.take(DeviceKey::Npu(0));
        assert_eq!(zero.first().unwrap().ts_ns, 2, "the oldest two went");
        assert!(zero.windows(2).all(|w| w[0].ts_ns < w[1].ts_ns));
        assert!(p.take(DeviceKey::Npu(0)).is_empty());
        assert_eq!(p.take(DeviceKey::Npu(1)).len(), PENDING_LIMIT / 2);
    }
}
