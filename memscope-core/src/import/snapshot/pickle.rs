//! A reader of pickles of plain values (dicts, lists, tuples, strings, numbers, booleans, None),
//! protocols 2 to 5, as Python's `pickle` and TorchScript's pickler write PyTorch's memory
//! snapshots. Anything that would name a class or call a function (`GLOBAL`, `REDUCE`, `BUILD`,
//! `NEWOBJ`, persistent ids, ...) is refused: nothing a pickle says is ever run.
//!
//! Why by hand: serde-pickle (which `export` uses to write) reads a value referenced twice
//! through another shared value as "recursive" and fails, and PyTorch's snapshots share every
//! frame list and frame dict between the entries and blocks that have them. Here shared values
//! are reference-counted, as Python's are.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// A decoded value. Lists and dicts are shared as Python shares them.
#[derive(Clone, Debug)]
pub(crate) enum Py {
    None,
    Bool(bool),
    Int(i128),
    Float(#[expect(dead_code, reason = "decoded for a complete reading; no snapshot field read is a float")] f64),
    Str(Rc<str>),
    Bytes(#[expect(dead_code, reason = "decoded for a complete reading; no snapshot field read is bytes")] Rc<[u8]>),
    List(Rc<RefCell<Vec<Py>>>),
    Tuple(Rc<Vec<Py>>),
    Dict(Rc<RefCell<Vec<(Py, Py)>>>),
    /// The stack mark of `MARK`.
    Mark,
}

impl Py {
    pub(crate) fn get(&self, key: &str) -> Option<Py> {
        match self {
            Py::Dict(d) => {
                d.borrow().iter().find(|(k, _)| matches!(k, Py::Str(s) if &**s == key)).map(|(_, v)| v.clone())
            }
            _ => None,
        }
    }

    pub(crate) fn items(&self) -> Option<Vec<Py>> {
        match self {
            Py::List(l) => Some(l.borrow().clone()),
            Py::Tuple(t) => Some(t.to_vec()),
            _ => None,
        }
    }

    pub(crate) fn text(&self) -> Option<String> {
        match self {
            Py::Str(s) => Some(s.to_string()),
            _ => None,
        }
    }

    pub(crate) fn int(&self) -> Option<i128> {
        match self {
            Py::Int(n) => Some(*n),
            Py::Bool(b) => Some(i128::from(*b)),
            _ => None,
        }
    }

    pub(crate) fn is_dict(&self) -> bool {
        matches!(self, Py::Dict(_))
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum PickleError {
    #[error("the pickle ends early (byte {0})")]
    Truncated(usize),
    #[error("opcode 0x{op:02x} at byte {at} names a class or calls a function, which a memory snapshot never does")]
    Code { op: u8, at: usize },
    #[error("opcode 0x{op:02x} at byte {at} is not one of a pickle of plain values")]
    Unknown { op: u8, at: usize },
    #[error("byte {0}: malformed (a stack or memo entry it needs is missing)")]
    Malformed(usize),
}

struct Vm<'b> {
    bytes: &'b [u8],
    at: usize,
    stack: Vec<Py>,
    memo: HashMap<u32, Py>,
}

impl<'b> Vm<'b> {
    fn take(&mut self, n: usize) -> Result<&'b [u8], PickleError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or(PickleError::Truncated(self.at))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }

    fn le(&mut self, n: usize) -> Result<u64, PickleError> {
        Ok(self.take(n)?.iter().rev().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn pop(&mut self) -> Result<Py, PickleError> {
        self.stack.pop().ok_or(PickleError::Malformed(self.at))
    }

    /// The items above the last mark, the mark removed.
    fn pop_mark(&mut self) -> Result<Vec<Py>, PickleError> {
        let mark = self.stack.iter().rposition(|v| matches!(v, Py::Mark)).ok_or(PickleError::Malformed(self.at))?;
        let items = self.stack.split_off(mark + 1);
        self.stack.pop();
        Ok(items)
    }

    fn text(&mut self, n: usize) -> Result<Py, PickleError> {
        let at = self.at;
        let s = std::str::from_utf8(self.take(n)?).map_err(|_| PickleError::Malformed(at))?;
        Ok(Py::Str(Rc::from(s)))
    }

    fn top(&mut self) -> Result<&Py, PickleError> {
        self.stack.last().ok_or(PickleError::Malformed(self.at))
    }

    fn extend(&mut self, items: Vec<Py>) -> Result<(), PickleError> {
        match self.top()? {
            Py::List(l) => {
                l.borrow_mut().extend(items);
                Ok(())
            }
            _ => Err(PickleError::Malformed(self.at)),
        }
    }

    fn set_items(&mut self, items: Vec<Py>) -> Result<(), PickleError> {
        if !items.len().is_multiple_of(2) {
            return Err(PickleError::Malformed(self.at));
        }
        let Py::Dict(d) = self.top()?.clone() else { return Err(PickleError::Malformed(self.at)) };
        let mut d = d.borrow_mut();
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            // A key given again replaces the value, as in Python.
            match d.iter_mut().find(|(old, _)| same_key(old, &k)) {
                Some(slot) => slot.1 = v,
                None => d.push((k, v)),
            }
        }
        Ok(())
    }

    fn memo_get(&mut self, id: u32) -> Result<(), PickleError> {
        let v = self.memo.get(&id).cloned().ok_or(PickleError::Malformed(self.at))?;
        self.stack.push(v);
        Ok(())
    }

    fn memo_put(&mut self, id: u32) -> Result<(), PickleError> {
        let v = self.top()?.clone();
        self.memo.insert(id, v);
        Ok(())
    }

    fn tuple(&mut self, n: usize) -> Result<(), PickleError> {
        let at = self.stack.len().checked_sub(n).ok_or(PickleError::Malformed(self.at))?;
        let items = self.stack.split_off(at);
        self.stack.push(Py::Tuple(Rc::new(items)));
        Ok(())
    }

    /// The value of a number, string or constant opcode.
    fn scalar(&mut self, op: u8, at: usize) -> Result<Py, PickleError> {
        Ok(match op {
            b'N' => Py::None,
            0x88 => Py::Bool(true),
            0x89 => Py::Bool(false),
            b'J' => {
                let v = self.le(4)? as u32 as i32;
                Py::Int(i128::from(v))
            }
            b'K' => Py::Int(i128::from(self.u8()?)),
            b'M' => {
                let v = self.le(2)?;
                Py::Int(i128::from(v))
            }
            0x8a => {
                let n = usize::from(self.u8()?);
                let v = long(self.take(n)?).ok_or(PickleError::Unknown { op, at })?;
                Py::Int(v)
            }
            b'G' => {
                let raw = self.take(8)?;
                let v = f64::from_be_bytes(raw.try_into().map_err(|_| PickleError::Malformed(at))?);
                Py::Float(v)
            }
            0x8c => {
                let n = usize::from(self.u8()?);
                self.text(n)?
            }
            b'X' => {
                let n = self.le(4)? as usize;
                self.text(n)?
            }
            0x8d => {
                let n = self.le(8)? as usize;
                self.text(n)?
            }
            b'C' | b'B' | 0x8e => {
                let n = match op {
                    b'C' => usize::from(self.u8()?),
                    b'B' => self.le(4)? as usize,
                    _ => self.le(8)? as usize,
                };
                Py::Bytes(Rc::from(self.take(n)?))
            }
            _ => return Err(PickleError::Unknown { op, at }),
        })
    }

    /// One opcode; `Some` at `STOP`.
    fn step(&mut self) -> Result<Option<Py>, PickleError> {
        let at = self.at;
        let op = self.u8()?;
        match op {
            0x80 => {
                self.u8()?; // PROTO
            }
            0x95 => {
                self.take(8)?; // FRAME: a length hint
            }
            b'.' => return Ok(Some(self.pop()?)),
            b'(' => self.stack.push(Py::Mark),
            b'}' => self.stack.push(Py::Dict(Rc::new(RefCell::new(Vec::new())))),
            b'N' | 0x88 | 0x89 | b'J' | b'K' | b'M' | 0x8a | b'G' | 0x8c | b'X' | 0x8d | b'C' | b'B' | 0x8e => {
                let v = self.scalar(op, at)?;
                self.stack.push(v);
            }
            b']' => self.stack.push(Py::List(Rc::new(RefCell::new(Vec::new())))),
            b')' => self.stack.push(Py::Tuple(Rc::new(Vec::new()))),
            b'a' => {
                let v = self.pop()?;
                self.extend(vec![v])?;
            }
            b'e' => {
                let items = self.pop_mark()?;
                self.extend(items)?;
            }
            b's' => {
                let v = self.pop()?;
                let k = self.pop()?;
                self.set_items(vec![k, v])?;
            }
            b'u' => {
                let items = self.pop_mark()?;
                self.set_items(items)?;
            }
            b't' => {
                let items = self.pop_mark()?;
                self.stack.push(Py::Tuple(Rc::new(items)));
            }
            0x85..=0x87 => self.tuple(usize::from(op - 0x84))?,
            b'q' => {
                let id = u32::from(self.u8()?);
                self.memo_put(id)?;
            }
            b'r' => {
                let id = self.le(4)? as u32;
                self.memo_put(id)?;
            }
            0x94 => {
                let id = self.memo.len() as u32;
                self.memo_put(id)?;
            }
            b'h' => {
                let id = u32::from(self.u8()?);
                self.memo_get(id)?;
            }
            b'j' => {
                let id = self.le(4)? as u32;
                self.memo_get(id)?;
            }
            b'0' => {
                self.pop()?;
            }
            // GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ(_EX), PERSID, BINPERSID, EXT*.
            b'c' | 0x93 | b'R' | b'b' | b'i' | b'o' | 0x81 | 0x92 | b'P' | b'Q' | 0x82..=0x84 => {
                return Err(PickleError::Code { op, at })
            }
            _ => return Err(PickleError::Unknown { op, at }),
        }
        Ok(None)
    }
}

/// Dict keys compare by value for strings and numbers (the keys a snapshot has).
fn same_key(a: &Py, b: &Py) -> bool {
    match (a, b) {
        (Py::Str(x), Py::Str(y)) => x == y,
        (Py::Int(x), Py::Int(y)) => x == y,
        _ => false,
    }
}

/// A two's-complement little-endian integer of `LONG1` (at most 16 bytes here).
fn long(bytes: &[u8]) -> Option<i128> {
    if bytes.is_empty() {
        return Some(0);
    }
    if bytes.len() > 16 {
        return None;
    }
    let mut buf = if bytes[bytes.len() - 1] & 0x80 != 0 { [0xff; 16] } else { [0; 16] };
    buf[..bytes.len()].copy_from_slice(bytes);
    Some(i128::from_le_bytes(buf))
}

/// Reads a whole pickle.
pub(crate) fn read(bytes: &[u8]) -> Result<Py, PickleError> {
    let mut vm = Vm { bytes, at: 0, stack: Vec::new(), memo: HashMap::new() };
    loop {
        if let Some(v) = vm.step()? {
            return Ok(v);
        }
    }
}
