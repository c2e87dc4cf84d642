//! `memscope-driver-query dcmi|nvml LIBRARY [--once]`: the helper process the tracer starts to
//! ask the driver's management library for memory figures (see the crate's doc and
//! [`memscope_driver::protocol`]). `--once` prints the hello and one reading, for a person
//! checking what the library answers.

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use memscope_driver::{dcmi::Dcmi, nvml::Nvml, protocol::READ, Hello, Message, Reading, Source, SourceKind};

const USAGE: &str = "usage: memscope-driver-query dcmi|nvml LIBRARY [--once]\n\
    Started by memscope-bpf to read the driver's memory figures; prints one JSON line per `read` \
    line on its input.";

fn wall_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

fn reading(source: &dyn Source, devices: &[u32]) -> Reading {
    let (start_wall, start) = (wall_ns(), Instant::now());
    let devices = devices.iter().map(|&d| source.read(d)).collect();
    let took_ns = start.elapsed().as_nanos() as u64;
    Reading { ts_ns: start_wall + took_ns / 2, took_ns, devices }
}

fn say(out: &mut impl Write, message: &Message) -> std::io::Result<()> {
    writeln!(out, "{}", message.line())?;
    out.flush()
}

fn serve(source: &dyn Source, once: bool) -> std::io::Result<()> {
    let devices = source.devices();
    let mut out = std::io::stdout().lock();
    if once {
        return say(&mut out, &Message::Reading(reading(source, &devices)));
    }
    for line in std::io::stdin().lock().lines() {
        if line?.trim() == READ {
            say(&mut out, &Message::Reading(reading(source, &devices)))?;
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let once = args.iter().any(|a| a == "--once");
    let plain: Vec<&String> = args.iter().filter(|a| *a != "--once").collect();
    let (Some(kind), Some(library), 2) = (plain.first().and_then(|k| SourceKind::parse(k)), plain.get(1), plain.len())
    else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let loaded: Result<Box<dyn Source>, _> = match kind {
        SourceKind::Dcmi => Dcmi::load(library).map(|s| Box::new(s) as Box<dyn Source>),
        SourceKind::Nvml => Nvml::load(library).map(|s| Box::new(s) as Box<dyn Source>),
    };
    let mut out = std::io::stdout().lock();
    let source = match loaded {
        Ok(source) => source,
        Err(e) => {
            let _ = say(&mut out, &Message::Error(e.to_string()));
            return ExitCode::FAILURE;
        }
    };
    let hello = Hello { source: kind, library: library.to_string(), devices: source.devices() };
    if say(&mut out, &Message::Hello(hello)).is_err() {
        return ExitCode::FAILURE;
    }
    drop(out);
    match serve(source.as_ref(), once) {
        Ok(()) => ExitCode::SUCCESS,
        // The tracer went away: nothing to tell anyone.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("memscope-driver-query: {e}");
            ExitCode::FAILURE
        }
    }
}
