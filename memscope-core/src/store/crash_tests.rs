//! Power cuts, replayed: a trace's DB is written under `strace`, which records every write,
//! truncation, sync, creation and removal of its files in order, with the bytes written. After
//! each step that changes what a disk must keep, the files are rebuilt as a power cut there
//! would leave them at worst: a file's writes only as far as its last sync (a write not synced
//! is lost), creations, truncations and removals as done (the file system's journal may commit
//! them at any time). SQLite then opens each rebuilt DB, as the next reader would, and it must be
//! whole (`integrity_check`) and hold every row whose commit had returned (the child writes a
//! marker after each), row for row as the finished trace has them.
//!
//! The ground truth is SQLite's reading of the files strace saw written, not the store's own
//! view. The page writer's orderings ([`super::bulk`]: pages synced before the commit that links
//! them, commits synced) are what this checks; without them the rebuilt DBs are corrupt or short.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use rusqlite::Connection;

use super::batch::single;
use super::insight::Head;
use super::sqlite::DbSink;
use super::{Attr, DbWriter, Format, Row, Sink};
use crate::model::DeviceKey;
use crate::vocab::{Event, EventType};

const CHILD: &str = "store::crash_tests::a_power_cut_at_any_point_keeps_every_committed_row_and_a_whole_db";
/// Enough commits for the WAL to reach its checkpoint (512 frames) during the trace.
const ROUNDS: u64 = 240;
const ROWS_PER_ROUND: u64 = 150;

fn row(id: u64) -> Row<'static> {
    let head = Head {
        event: Event::parse(if id.is_multiple_of(2) { "FREE" } else { "MALLOC" }).unwrap(),
        event_type: EventType::parse("HAL").unwrap(),
        ts_ns: id * 1_000,
        pid: 7,
        tid: 7,
        device: DeviceKey::Npu(0),
        ptr: Some(0x1000 * id),
        broadcast: false,
        untracked: false,
        shadow: false,
    };
    let owner = "o".repeat((id % 900) as usize);
    Row { head, name: "aclrtMalloc".into(), attr: Attr::new().with("size", id).with("owner", owner) }
}

/// The traced child: commits in rounds, says so after each commit returns, then stops as a
/// trace does (rows after `stopping`, then `finish`).
fn child(dir: &Path) {
    let mut markers = std::fs::File::create(dir.join("markers")).unwrap();
    let path = dir.join("memscope_dump_20260101000000.db");
    let mut sink = Box::new(DbSink::create(&path, DeviceKey::Npu(0), &vec![], DbWriter::Pages).unwrap());
    let mut id = 0;
    for _ in 0..ROUNDS {
        for _ in 0..ROWS_PER_ROUND {
            id += 1;
            sink.insert(id, single(&row(id), Format::Db).get(0)).unwrap();
        }
        sink.commit().unwrap();
        markers.write_all(format!("committed {id}\n").as_bytes()).unwrap();
    }
    sink.stopping().unwrap();
    for _ in 0..ROWS_PER_ROUND {
        id += 1;
        sink.insert(id, single(&row(id), Format::Db).get(0)).unwrap();
    }
    sink.finish(&vec![], &[]).unwrap();
    markers.write_all(format!("committed {id}\n").as_bytes()).unwrap();
}

/// One step strace saw, on a file of the DB's folder.
#[derive(Debug)]
enum Op {
    Create(PathBuf),
    Write {
        file: PathBuf,
        at: u64,
        data: Vec<u8>,
    },
    Truncate {
        file: PathBuf,
        len: u64,
    },
    Sync(PathBuf),
    Remove(PathBuf),
    /// The child's marker: this many rows were committed when it was written.
    Committed(u64),
}

/// `\xHH` escapes (strace -xx writes every byte so) back to bytes.
fn unhex(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    assert!(b.len().is_multiple_of(4), "not strace -xx text: {s:.40}");
    b.chunks(4)
        .map(|c| {
            assert_eq!(&c[..2], b"\\x", "not strace -xx text: {s:.40}");
            u8::from_str_radix(std::str::from_utf8(&c[2..]).unwrap(), 16).unwrap()
        })
        .collect()
}

/// Splits a call's arguments at the commas outside quotes and `<...>`.
fn args(text: &str) -> Vec<&str> {
    let (mut out, mut start, mut quoted, mut angle) = (Vec::new(), 0, false, 0);
    for (i, c) in text.char_indices() {
        match c {
            '"' => quoted = !quoted,
            '<' if !quoted => angle += 1,
            '>' if !quoted => angle -= 1,
            ',' if !quoted && angle == 0 => {
                out.push(text[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(text[start..].trim());
    out
}

/// `3<\x2f...>` (strace -y) to its path.
fn fd_path(arg: &str) -> PathBuf {
    let open = arg.find('<').unwrap_or_else(|| panic!("no path on {arg:.60}"));
    PathBuf::from(String::from_utf8(unhex(&arg[open + 1..arg.len() - 1])).unwrap())
}

fn quoted(arg: &str) -> Vec<u8> {
    assert!(arg.starts_with('"') && arg.ends_with('"'), "a truncated or odd string: {arg:.60}");
    unhex(&arg[1..arg.len() - 1])
}

/// The steps on files under `dir`, in order, from strace's log.
fn ops(log: &str, dir: &Path) -> Vec<Op> {
    let mut out = Vec::new();
    for line in log.lines() {
        // `-f` prefixes the thread id.
        let line = line.trim_start_matches(|c: char| c.is_ascii_digit()).trim_start();
        // `name(args) = ret`, strace padding the space before `=` to a column.
        let (Some(open), Some(eq)) = (line.find('('), line.rfind(" = ")) else { continue };
        let Some(close) = line[..eq].trim_end().strip_suffix(')').map(str::len) else { continue };
        let (name, ret) = (&line[..open], line[eq + 3..].trim());
        let a = args(&line[open + 1..close]);
        let mine = |p: &Path| p.starts_with(dir);
        if ret.starts_with('-') {
            continue; // a failed call changed nothing
        }
        match name {
            "openat" => {
                let path = PathBuf::from(String::from_utf8(quoted(a[1])).unwrap());
                if mine(&path) && a[2].contains("O_CREAT") {
                    out.push(Op::Create(path));
                }
            }
            "pwrite64" | "write" => {
                let file = fd_path(a[0]);
                if !mine(&file) {
                    continue;
                }
                let data = quoted(a[1]);
                assert_eq!(ret.parse::<usize>().unwrap(), data.len(), "a short write: {line:.80}");
                if file.ends_with("markers") {
                    let text = String::from_utf8(data).unwrap();
                    out.push(Op::Committed(text.trim().strip_prefix("committed ").unwrap().parse().unwrap()));
                } else {
                    assert_eq!(name, "pwrite64", "a write at the file offset on {}", file.display());
                    out.push(Op::Write { file, at: a[3].parse().unwrap(), data });
                }
            }
            "ftruncate" if mine(&fd_path(a[0])) => {
                out.push(Op::Truncate { file: fd_path(a[0]), len: a[1].parse().unwrap() })
            }
            "fsync" | "fdatasync" if mine(&fd_path(a[0])) => out.push(Op::Sync(fd_path(a[0]))),
            "unlink" | "unlinkat" => {
                let path = PathBuf::from(String::from_utf8(quoted(a[usize::from(name == "unlinkat")])).unwrap());
                if mine(&path) {
                    out.push(Op::Remove(path));
                }
            }
            "fallocate" | "pwritev" | "pwritev2" | "writev" | "rename" | "renameat" | "renameat2" => {
                assert!(!line.contains(&*hex_of(dir)), "a call this replay does not model: {line:.80}")
            }
            _ => {}
        }
    }
    out
}

fn hex_of(dir: &Path) -> String {
    dir.as_os_str().as_encoded_bytes().iter().map(|b| format!("\\x{b:02x}")).collect()
}

/// A file as the disk keeps it, and the writes it has not synced yet.
#[derive(Default)]
struct File {
    durable: Vec<u8>,
    pending: Vec<(u64, Vec<u8>)>,
}

fn put(image: &mut Vec<u8>, at: u64, data: &[u8]) {
    let end = at as usize + data.len();
    if image.len() < end {
        image.resize(end, 0);
    }
    image[at as usize..end].copy_from_slice(data);
}

/// Writes the durable files into `into` (emptied first) under their names.
fn rebuild(files: &BTreeMap<PathBuf, File>, into: &Path) {
    let _ = std::fs::remove_dir_all(into);
    std::fs::create_dir_all(into).unwrap();
    for (path, file) in files {
        // The -shm index is rebuilt from the WAL by the next opener; markers are not the DB's.
        let name = path.file_name().unwrap().to_string_lossy();
        if !name.ends_with("-shm") && name != "markers" {
            std::fs::write(into.join(&*name), &file.durable).unwrap();
        }
    }
}

fn rows_of(db: &Path) -> Result<Vec<(i64, String)>, String> {
    let conn = Connection::open(db).map_err(|e| e.to_string())?;
    let ok: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0)).map_err(|e| e.to_string())?;
    if ok != "ok" {
        return Err(ok);
    }
    // Before its first durable commit the file may hold no table yet: a DB all the same.
    let tables: i64 = conn
        .query_row("SELECT count(*) FROM sqlite_master WHERE name = 'memscope_dump'", [], |r| r.get(0))
        .map_err(|e| e.to_string())?;
    if tables == 0 {
        return Ok(Vec::new());
    }
    let mut stmt = conn.prepare("SELECT ID, Attr FROM memscope_dump ORDER BY rowid").map_err(|e| e.to_string())?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).map_err(|e| e.to_string())?;
    rows.collect::<Result<_, _>>().map_err(|e| e.to_string())
}

#[test]
fn a_power_cut_at_any_point_keeps_every_committed_row_and_a_whole_db() {
    if let Some(dir) = std::env::var_os("MEMSCOPE_CRASH_CHILD") {
        return child(Path::new(&dir));
    }
    let Ok(version) = std::process::Command::new("strace").arg("-V").output() else {
        eprintln!("skipped: no strace to record the writes (cargo xtask setup installs it)");
        return;
    };
    assert!(version.status.success());
    let base = std::env::temp_dir().join(format!("memscope-crash-{}", std::process::id()));
    let (dir, log) = (base.join("trace"), base.join("strace.log"));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&dir).unwrap();
    let status = std::process::Command::new("strace")
        .args(["-f", "-qq", "-y", "-xx", "-s", "8388608", "-o"])
        .arg(&log)
        .args(["-e", "signal=none", "-e"])
        .arg(format!(
            "trace=openat,write,pwrite64,pwritev,pwritev2,writev,fsync,fdatasync,ftruncate,fallocate,{}",
            "unlink,unlinkat,rename,renameat,renameat2"
        ))
        .arg("--")
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", CHILD, "--test-threads=1"])
        .env("MEMSCOPE_CRASH_CHILD", &dir)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "the traced child failed");
    let final_rows = rows_of(&dir.join("memscope_dump_20260101000000.db")).unwrap();
    assert_eq!(final_rows.len() as u64, ROUNDS * ROWS_PER_ROUND + ROWS_PER_ROUND);
    let ops = ops(&std::fs::read_to_string(&log).unwrap(), &dir);
    let _ = std::fs::remove_file(&log);
    check_every_cut(&ops, &final_rows, &base.join("cut"));
    std::fs::remove_dir_all(&base).unwrap();
}

/// Replays `ops`, checking the DB a power cut would leave after each step that changes it.
fn check_every_cut(ops: &[Op], final_rows: &[(i64, String)], scratch: &Path) {
    let mut files: BTreeMap<PathBuf, File> = BTreeMap::new();
    let (mut committed, mut cuts, mut syncs_of_wal) = (0u64, 0, 0);
    let db_name = "memscope_dump_20260101000000.db";
    for (i, op) in ops.iter().enumerate() {
        match op {
            Op::Committed(n) => committed = *n,
            Op::Create(p) => {
                files.entry(p.clone()).or_default();
            }
            Op::Write { file, at, data } => files.entry(file.clone()).or_default().pending.push((*at, data.clone())),
            Op::Truncate { file, len } => {
                // The new length is metadata, kept at once; writes not synced past it are gone.
                let (f, len) = (files.entry(file.clone()).or_default(), *len as usize);
                f.durable.resize(len, 0);
                for (at, data) in &mut f.pending {
                    data.truncate(len.saturating_sub(*at as usize));
                }
            }
            Op::Sync(file) => {
                syncs_of_wal += usize::from(file.to_string_lossy().ends_with("-wal"));
                let f = files.entry(file.clone()).or_default();
                for (at, data) in std::mem::take(&mut f.pending) {
                    put(&mut f.durable, at, &data);
                }
            }
            Op::Remove(p) => {
                files.remove(p);
            }
        }
        if matches!(op, Op::Write { .. } | Op::Committed(_)) {
            continue;
        }
        if !files.keys().any(|p| p.ends_with(db_name)) {
            continue;
        }
        rebuild(&files, scratch);
        cuts += 1;
        let rows = rows_of(&scratch.join(db_name))
            .unwrap_or_else(|e| panic!("a power cut after step {i} ({op:?}) leaves a broken DB: {e}"));
        assert!(
            rows.len() as u64 >= committed,
            "a power cut after step {i} ({op:?}) loses committed rows: {} of {committed} left",
            rows.len()
        );
        assert!(rows[..] == final_rows[..rows.len()], "a power cut after step {i} leaves other rows than the trace's");
    }
    assert!(
        syncs_of_wal > 2 && cuts > 100,
        "the replay saw the trace's syncs ({syncs_of_wal} of the WAL, {cuts} cuts)"
    );
    assert_eq!(committed, final_rows.len() as u64, "the child's last marker was seen");
}
