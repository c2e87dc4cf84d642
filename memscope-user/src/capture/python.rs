//! A traced process's CPython, found and handed to the probe (which walks its frames) and to
//! the ring's consumer (which reads its code objects): the trace session and the daemon alike.

use anyhow::Context as _;

use super::ring::Consumer;
use crate::attach::loader::Tracer;
use memscope_core::printable::printable;

/// Registers `pid`'s interpreter; returns the line to say, or `None` when the process runs no
/// Python (yet: a process that loads it later is looked at again by the caller).
pub fn register(tracer: &mut Tracer, consumer: &mut Consumer, pid: u32) -> anyhow::Result<Option<String>> {
    match memscope_core::stacks::python::find(pid) {
        Ok(None) => Ok(None),
        Ok(Some(py)) => {
            let process = memscope_common::python::PyProcess { runtime: py.runtime, offsets: py.walk };
            tracer.set_python(pid, process).context("cannot register the Python interpreter")?;
            consumer.set_python(pid, py.layout);
            let path = py.path.to_string_lossy();
            Ok(Some(format!("python: CPython 3.{} in process {pid} ({})", py.minor, printable(&path))))
        }
        Err(e) => Ok(Some(format!("python: process {pid}: no Python stacks: {}", printable(&e.to_string())))),
    }
}
