//! Rows formatted on the producing side, in batches moved whole to the store thread.
//!
//! A row's text columns (Attr, Name, Ptr) are written once, back to back, into the batch's one
//! buffer as soon as the row is made; the fixed columns stay typed beside it (an [`insight::Head`]). A
//! model output's row is written there directly ([`Batch::push_output`]): its Attr's pairs go
//! into the buffer as they are made, with nothing built or copied in between (which was most of
//! the session thread's time per row). A batch is two allocations for a thousand rows, and the
//! writer hands emptied batches back for reuse, so steady state allocates nothing per row on
//! either thread.

use super::attr::push_addr;
use super::insight::{self, is_untracked_free, Head, Row};
use super::Format;
use crate::model::{DeviceKey, Output};
use crate::stacks::{StackId, NO_STACK};

/// A row's typed columns, and where its text columns are in the batch's buffer.
#[derive(Clone, Debug)]
struct Slot {
    head: Head,
    stack: StackId,
    py_stack: StackId,
    /// Attr is `text[start..attr_end]`, Name `text[attr_end..name_end]`, Ptr
    /// `text[name_end..end]`: the Attr comes first because it is written before the model
    /// output has given the other columns.
    start: u32,
    attr_end: u32,
    name_end: u32,
    end: u32,
}

/// One row of a batch: its head and its text columns.
#[derive(Clone, Copy, Debug)]
pub struct RowText<'t> {
    pub head: &'t Head,
    pub name: &'t str,
    /// `0x%016x` or `N/A`.
    pub ptr: &'t str,
    /// JSON for a DB, msMemScope's `{k:v,...}` for CSV.
    pub attr: &'t str,
    /// The call's native and Python stacks.
    pub stack: StackId,
    pub py_stack: StackId,
    /// Its `Call Stack(C)` text: "" in a batch; the store's thread, which symbolizes the
    /// stacks, fills it in ([`super::Store::write_batch`]).
    pub c_stack: &'t str,
    /// Its `Call Stack(Python)` text, filled in as `c_stack`.
    pub py_text: &'t str,
}

#[derive(Debug, Default)]
pub struct Batch {
    text: String,
    slots: Vec<Slot>,
}

fn offset(text: &str) -> u32 {
    u32::try_from(text.len()).expect("a batch's text stays far under 4 GiB")
}

impl Batch {
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn clear(&mut self) {
        self.text.clear();
        self.slots.clear();
    }

    /// Formats `row` (its Attr in `format`'s form), made by a call with `stack`, onto the end
    /// of the batch.
    pub fn push(&mut self, row: &Row<'_>, format: Format, stacks: (StackId, StackId)) {
        let start = offset(&self.text);
        match format {
            Format::Db => row.attr.write_json(&mut self.text),
            Format::Csv => row.attr.write_csv_form(&mut self.text),
        }
        let head = Head { untracked: is_untracked_free(row), ..row.head };
        let slot = Slot {
            head,
            stack: stacks.0,
            py_stack: stacks.1,
            start,
            attr_end: offset(&self.text),
            name_end: 0,
            end: 0,
        };
        self.text.push_str(&row.name);
        self.push_ptr(slot);
    }

    /// Formats the row of a model output onto the end of the batch, its Attr as JSON (a DB's
    /// form) written in place; false, with nothing added, for an output that is no row
    /// ([`Output::Retag`]). `stack` is the native stack of the call that made it.
    pub fn push_output(&mut self, output: &Output, stacks: (StackId, StackId), extra: &[(&'static str, u64)]) -> bool {
        let start = offset(&self.text);
        let Some(c) = insight::write_row(output, &mut self.text, extra) else { return false };
        let slot = Slot {
            head: c.head,
            stack: stacks.0,
            py_stack: stacks.1,
            start,
            attr_end: offset(&self.text),
            name_end: 0,
            end: 0,
        };
        c.name.write(&mut self.text);
        self.push_ptr(slot);
        true
    }

    /// Ends a row whose Attr and Name were just written (`slot.attr_end` is where its Attr
    /// ended): its Ptr, then its slot.
    fn push_ptr(&mut self, mut slot: Slot) {
        let text = &mut self.text;
        slot.name_end = offset(text);
        write_ptr(slot.head.ptr, text);
        slot.end = offset(text);
        self.slots.push(slot);
    }

    /// Copies a row of another batch onto the end of this one.
    pub fn push_text(&mut self, row: RowText<'_>) {
        let start = offset(&self.text);
        for part in [row.attr, row.name, row.ptr] {
            self.text.push_str(part);
        }
        let attr_end = start + offset(row.attr);
        let name_end = attr_end + offset(row.name);
        let end = offset(&self.text);
        self.slots.push(Slot {
            head: *row.head,
            stack: row.stack,
            py_stack: row.py_stack,
            start,
            attr_end,
            name_end,
            end,
        });
    }

    pub fn get(&self, i: usize) -> RowText<'_> {
        let slot = &self.slots[i];
        let at = |from: u32, to: u32| &self.text[from as usize..to as usize];
        RowText {
            head: &slot.head,
            name: at(slot.attr_end, slot.name_end),
            ptr: at(slot.name_end, slot.end),
            attr: at(slot.start, slot.attr_end),
            stack: slot.stack,
            py_stack: slot.py_stack,
            c_stack: "",
            py_text: "",
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = RowText<'_>> {
        (0..self.len()).map(|i| self.get(i))
    }
}

/// A row formatted on its own (the store's START/STOP rows, tests).
pub fn single(row: &Row<'_>, format: Format) -> Batch {
    let mut batch = Batch::default();
    batch.push(row, format, (NO_STACK, NO_STACK));
    batch
}

/// Appends a `Device Id` column: the device number, `cpu`, or `N/A`.
pub fn write_device_id(device: DeviceKey, out: &mut String) {
    match device {
        DeviceKey::Npu(n) => out.push_str(itoa::Buffer::new().format(n)),
        DeviceKey::Cpu => out.push_str("cpu"),
        DeviceKey::Unknown => out.push_str("N/A"),
    }
}

/// Appends a `Ptr` column: `0x%016x`, or `N/A`.
pub fn write_ptr(ptr: Option<u64>, out: &mut String) {
    match ptr {
        Some(p) => push_addr(out, p),
        None => out.push_str("N/A"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Attr;
    use crate::vocab::{Event, EventType};

    fn row(name: &str, ptr: Option<u64>, attr: Attr, untracked: bool, shadow: bool) -> Row<'static> {
        Row {
            head: Head {
                event: Event::parse("FREE").unwrap(),
                event_type: EventType::parse("HAL").unwrap(),
                ts_ns: 3,
                pid: 1,
                tid: 2,
                device: DeviceKey::Npu(0),
                ptr,
                broadcast: false,
                untracked,
                shadow,
            },
            name: name.to_owned().into(),
            attr,
        }
    }

    #[test]
    fn each_row_reads_back_its_own_columns() {
        let mut batch = Batch::default();
        let shadow = Attr::new().with("size", 8u64).with("shadow", "true");
        batch.push(&row("aclrtFree", Some(0x10), shadow, false, true), Format::Db, (NO_STACK, NO_STACK));
        batch.push(
            &row("", None, Attr::new().with("unmatched", "true"), true, false),
            Format::Csv,
            (NO_STACK, NO_STACK),
        );
        let mut copy = Batch::default();
        copy.push_text(batch.get(1));
        copy.push_text(batch.get(0));
        let a = copy.get(1);
        assert_eq!((a.name, a.ptr, a.attr), ("aclrtFree", "0x0000000000000010", r#"{"size":"8","shadow":"true"}"#));
        assert!(a.head.shadow && !a.head.untracked);
        let b = copy.get(0);
        assert_eq!((b.name, b.ptr, b.attr), ("", "N/A", "{unmatched:true}"));
        assert!(b.head.untracked && !b.head.shadow);
        assert_eq!(copy.iter().count(), 2);
    }
}
