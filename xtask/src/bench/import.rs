//! Reading msMemScope's CSV (`cargo xtask bench --import-only`, and in the full run): a CSV
//! written as msMemScope writes one (bare Attr, a block's MALLOC with its FREE, so rows out of
//! time order), timed through `memscope-bpf import`, against SQLite's own `.import --csv` of the
//! same file (the peer: a plain copy of the text into a table, no Attr conversion), alternating
//! in the same run; then `analyze --analysis leaks` straight on the CSV (its temporary import
//! included) and on the imported DB.

use std::io::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::Context as _;

use super::measure::{median, run_capture};

/// Writes `blocks` PTA blocks (2 rows each) over `steps` mstx steps; a tenth of them live for a
/// while (their rows come late), as a training step's activations do.
fn write_csv(path: &Path, blocks: u64) -> anyhow::Result<u64> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(out, "ID,Event,Event Type,Name,Timestamp(ns),Process Id,Thread Id,Device Id,Ptr,Attr,Call Stack(Python),Call Stack(C)")?;
    let (mut id, mut ts, mut rows) = (0u64, 1_700_000_000_000_000_000u64, 0u64);
    let mut held: Vec<(u64, u64, u64, u64)> = Vec::new();
    let row = |out: &mut std::io::BufWriter<std::fs::File>,
               id: u64,
               ev: &str,
               ts: u64,
               addr: u64,
               size: u64,
               alloc: u64| {
        writeln!(
            out,
            "{id},{ev},PTA,N/A,{ts},4242,4243,0,0x{addr:016x},\"{{allocation_id:{alloc},addr:0x{addr:016x},size:{size},total:268435456,used:{size},owner:PTA@ops@aten}}\",NA,"
        )
    };
    for block in 0..blocks {
        if block % 100_000 == 0 {
            id += 1;
            ts += 1000;
            writeln!(out, "{id},MSTX,Range_start,\"step start\",{ts},4242,4243,0,N/A,,NA,")?;
            rows += 1;
        }
        let addr = 0x12c0_0000_0000 + (block % 50_000) * 0x10000;
        let size = [512u64, 4096, 1 << 20][(block % 3) as usize];
        id += 1;
        ts += 1000;
        let malloc = (id, ts, addr, size);
        if block % 10 == 0 {
            held.push(malloc);
            continue;
        }
        id += 1;
        ts += 500;
        row(&mut out, malloc.0, "MALLOC", malloc.1, addr, size, block)?;
        row(&mut out, id, "FREE", ts, addr, size, block)?;
        rows += 2;
        if held.len() >= 64 {
            for (mid, mts, maddr, msize) in held.drain(..) {
                id += 1;
                row(&mut out, mid, "MALLOC", mts, maddr, msize, mid)?;
                row(&mut out, id, "FREE", ts, maddr, msize, mid)?;
                rows += 2;
            }
        }
    }
    out.flush()?;
    Ok(rows)
}

fn timed(cmd: &mut Command) -> anyhow::Result<f64> {
    let started = Instant::now();
    run_capture(cmd)?;
    Ok(started.elapsed().as_secs_f64())
}

pub fn run(binary: &Path, dir: &Path, blocks: u64, rounds: usize) -> anyhow::Result<String> {
    std::fs::create_dir_all(dir)?;
    let csv = dir.join("memscope_dump_20250101000000.csv");
    eprintln!("xtask bench: writing an msMemScope CSV of {blocks} blocks");
    let rows = write_csv(&csv, blocks)?;
    let size = std::fs::metadata(&csv)?.len() as f64 / (1 << 20) as f64;
    let (ours_db, peer_db) = (dir.join("memscope_dump_20250101000000.db"), dir.join("peer.db"));
    let have_sqlite = crate::util::output(Command::new("sqlite3").arg("--version")).is_some();
    let (mut ours, mut peer) = (Vec::new(), Vec::new());
    for round in 1..=rounds {
        eprintln!("xtask bench: import round {round}/{rounds}");
        ours.push(timed(Command::new(binary).arg("import").arg(&csv).arg("--force"))?);
        if have_sqlite {
            let _ = std::fs::remove_file(&peer_db);
            let import = format!(".import --csv {} memscope_dump", csv.display());
            peer.push(timed(Command::new("sqlite3").arg(&peer_db).arg(import))?);
        }
    }
    let leaks = |input: &Path| -> anyhow::Result<f64> {
        timed(Command::new(binary).args(["analyze", "--analysis", "leaks", "--no-write"]).arg(input))
    };
    let on_csv = leaks(&csv).context("analyze on the CSV")?;
    let on_db = leaks(&ours_db).context("analyze on the imported DB")?;
    let o = median(ours.clone());
    let mut md = format!(
        "\n## msMemScope's CSV (`cargo xtask bench --import-only --import-blocks {blocks}`)\n\n\
         {rows} rows ({size:.0} MiB, bare Attr, a tenth of the blocks written late as msMemScope writes them). \
         Median of {rounds} runs, alternating.\n\n\
         | reader | seconds | rows/s |\n|---|---|---|\n\
         | memscope-bpf import (Attr to JSON, columns checked) | {o:.2} | {:.0} |\n",
        rows as f64 / o
    );
    if have_sqlite {
        let p = median(peer);
        md.push_str(&format!(
            "| sqlite3 .import --csv (plain text copy, the peer) | {p:.2} | {:.0} |\n",
            rows as f64 / p
        ));
    } else {
        md.push_str("| sqlite3 .import --csv | not installed | |\n");
    }
    md.push_str(&format!(
        "\n`analyze --analysis leaks --no-write`: {on_csv:.2} s on the CSV (its temporary import included), \
         {on_db:.2} s on the imported DB.\n"
    ));
    Ok(md)
}
