//! The CSV sink: msMemScope's dump CSV (header `ID,Event,...,Call Stack(C)`, Attr quoted in its
//! `{k:v,...}` form). Our own tables have no CSV form; their facts are in the DB format only,
//! except the frees of blocks the trace never saw allocated, which go to a file of their own
//! beside the dump (`ms_untracked_frees_<digits>.csv`, the same columns), as they go to a table
//! of their own in a DB.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::batch::{write_device_id, RowText};
use super::owner::Owner;
use super::schema::{csv_header, UNTRACKED_FREES_TABLE};
use super::{Meta, ProbeRow, Sink, StoreError};
use crate::model::DeviceKey;

pub struct CsvSink {
    out: BufWriter<File>,
    path: PathBuf,
    /// The `Device Id` of every row.
    device: String,
    owner: Owner,
    /// Created on the first untracked free.
    untracked: Option<(BufWriter<File>, PathBuf)>,
}

/// RFC 4180 quoting: only when needed, doubling inner quotes.
pub fn field(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_owned()
    }
}

impl CsvSink {
    /// A new CSV at `path` for `device`'s rows.
    pub fn create(path: &Path, device: DeviceKey, owner: Owner) -> Result<Self, StoreError> {
        let io = |source| StoreError::Io { path: path.to_owned(), source };
        let file = owner.create_file(path).map_err(io)?;
        let mut out = BufWriter::new(file);
        writeln!(out, "{}", csv_header()).map_err(io)?;
        let mut text = String::new();
        write_device_id(device, &mut text);
        Ok(Self { out, path: path.to_owned(), device: text, owner, untracked: None })
    }

    /// `ms_untracked_frees_<digits>.csv` beside `memscope_dump_<digits>.csv`.
    fn untracked_path(&self) -> PathBuf {
        let name = self.path.file_name().and_then(|n| n.to_str()).unwrap_or("memscope_dump.csv");
        let digits = name.strip_prefix("memscope_dump_").unwrap_or(name);
        self.path.with_file_name(format!("{UNTRACKED_FREES_TABLE}_{digits}"))
    }

    fn io(&self) -> impl Fn(std::io::Error) -> StoreError + '_ {
        move |source| StoreError::Io { path: self.path.clone(), source }
    }
}

/// One CSV line for a row of `device` (without the newline); `row.attr` is in the CSV form.
pub fn line(id: u64, row: RowText<'_>, device: &str) -> String {
    // msMemScope always quotes the Attr field.
    let attr = format!("\"{}\"", row.attr.replace('"', "\"\""));
    let head = row.head;
    [
        id.to_string(),
        field(head.event.as_str()),
        field(head.event_type.as_str()),
        field(row.name),
        head.ts_ns.to_string(),
        head.pid.to_string(),
        head.tid.to_string(),
        field(device),
        field(row.ptr),
        attr,
        field(row.py_text),
        field(row.c_stack),
    ]
    .join(",")
}

impl Sink for CsvSink {
    fn insert(&mut self, id: u64, row: RowText<'_>) -> Result<(), StoreError> {
        writeln!(self.out, "{}", line(id, row, &self.device)).map_err(self.io())
    }

    fn insert_untracked(&mut self, id: u64, row: RowText<'_>) -> Result<(), StoreError> {
        if self.untracked.is_none() {
            let path = self.untracked_path();
            let io = |source| StoreError::Io { path: path.clone(), source };
            let mut out = BufWriter::new(self.owner.create_file(&path).map_err(io)?);
            writeln!(out, "{}", csv_header()).map_err(io)?;
            self.untracked = Some((out, path));
        }
        let (out, path) = self.untracked.as_mut().expect("created above");
        writeln!(out, "{}", line(id, row, &self.device)).map_err(|source| StoreError::Io { path: path.clone(), source })
    }

    fn commit(&mut self) -> Result<(), StoreError> {
        if let Some((out, path)) = &mut self.untracked {
            out.flush().map_err(|source| StoreError::Io { path: path.clone(), source })?;
        }
        self.out.flush().map_err(self.io())
    }

    fn add_probes(&mut self, _probes: &[ProbeRow]) -> Result<(), StoreError> {
        Ok(())
    }

    /// A CSV line cannot be changed once written: the MALLOC keeps the owner it was born with
    /// (documented in docs/db-schema.md; use the DB format for address tags).
    fn update_owner(&mut self, _id: u64, _owner: &str, _source: Option<&'static str>) -> Result<(), StoreError> {
        Ok(())
    }

    fn finish(mut self: Box<Self>, _meta: &Meta, _lost: &[u64]) -> Result<PathBuf, StoreError> {
        self.commit()?;
        self.out.get_ref().sync_all().map_err(self.io())?;
        Ok(self.path.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::batch::single;
    use crate::store::insight::Head;
    use crate::store::{Attr, Format, Row};
    use crate::vocab::{Event, EventType};

    #[test]
    fn header_is_msmemscopes() {
        assert_eq!(
            csv_header(),
            "ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr,Call Stack(Python),Call Stack(C)"
        );
    }

    #[test]
    fn row_line_has_twelve_fields_and_quoted_attr() {
        let row = Row {
            head: Head {
                event: Event::parse("MALLOC").unwrap(),
                event_type: EventType::parse("HAL").unwrap(),
                ts_ns: 17,
                pid: 3,
                tid: 4,
                device: DeviceKey::Npu(1),
                ptr: Some(0xff),
                broadcast: false,
                untracked: false,
                shadow: false,
            },
            name: "aclrtMalloc".into(),
            attr: Attr::new().addr("addr", 0xff).with("size", 9u64),
        };
        let l = line(5, single(&row, Format::Csv).get(0), "1");
        assert_eq!(l, "5,MALLOC,HAL,aclrtMalloc,17,3,4,1,0x00000000000000ff,\"{addr:0x00000000000000ff,size:9}\",,");
        // Parse it back with a minimal RFC 4180 reader: 12 fields.
        let mut fields = Vec::new();
        let mut cur = String::new();
        let mut quoted = false;
        for ch in l.chars() {
            match ch {
                '"' => quoted = !quoted,
                ',' if !quoted => fields.push(std::mem::take(&mut cur)),
                c => cur.push(c),
            }
        }
        fields.push(cur);
        assert_eq!(fields.len(), 12);
        assert_eq!(fields[9], "{addr:0x00000000000000ff,size:9}");
    }
}
