//! The pages of an append-only SQLite rowid table, built in memory (no I/O).
//!
//! Why by hand: inserting through SQL costs a VDBE program, twelve binds, a record copy and a
//! B-tree descent per row, most of the store thread's time at a million rows a second. Rows that
//! only ever go on the end of a table can instead be packed into leaf pages as they come, and the
//! few interior pages above them rebuilt whenever the table must be readable; SQLite has no bulk
//! load that does this. [`super::bulk`] writes the pages through SQLite's own pager, so locking,
//! the WAL and readers work as for any other write.
//!
//! Everything here follows the file format (<https://sqlite.org/fileformat2.html>): big-endian
//! varints, records of serial types, table leaf (0x0D) and interior (0x05) pages with their cell
//! pointer arrays, overflow chains for payloads too large for a page, and the pending-byte page,
//! which no B-tree may use. The builder keeps every invariant SQLite checks (`PRAGMA
//! integrity_check`): keys ascending, every interior page with at least one cell, all leaves at
//! one depth, every page it allocates referenced.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum BtreeError {
    #[error("page {pgno} of the table is not a table B-tree page (type {kind:#x})")]
    NotTablePage { pgno: u32, kind: u8 },
    #[error("page {pgno} of the table is malformed: {what}")]
    Malformed { pgno: u32, what: &'static str },
    #[error("the table is deeper than any table this tracer writes (over {0} levels)")]
    TooDeep(usize),
}

/// One column value of a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Col<'a> {
    Int(i64),
    Text(&'a str),
}

/// Appends `v` as an SQLite varint (big-endian, 7 bits a byte, a full 9th byte).
#[inline]
pub fn put_varint(out: &mut Vec<u8>, v: u64) {
    // Serial types and lengths of short texts: the one- and two-byte forms are nearly all.
    if v < 0x80 {
        out.push(v as u8);
    } else if v < 0x4000 {
        out.extend_from_slice(&[(v >> 7) as u8 | 0x80, v as u8 & 0x7f]);
    } else {
        put_long_varint(out, v);
    }
}

fn put_long_varint(out: &mut Vec<u8>, v: u64) {
    if v >> 56 != 0 {
        let mut bytes = [0u8; 9];
        bytes[8] = v as u8;
        let mut rest = v >> 8;
        for b in bytes[..8].iter_mut().rev() {
            *b = (rest as u8 & 0x7f) | 0x80;
            rest >>= 7;
        }
        out.extend_from_slice(&bytes);
        return;
    }
    let len = varint_len(v);
    for i in (0..len).rev() {
        let byte = ((v >> (7 * i)) & 0x7f) as u8;
        out.push(if i == 0 { byte } else { byte | 0x80 });
    }
}

pub fn varint_len(v: u64) -> usize {
    match v {
        _ if v >> 56 != 0 => 9,
        _ => (64 - v.leading_zeros() as usize).max(1).div_ceil(7),
    }
}

/// Reads a varint at the start of `b`: its value and length.
pub fn get_varint(b: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, &byte) in b.iter().enumerate().take(9) {
        if i == 8 {
            return Some(((v << 8) | u64::from(byte), 9));
        }
        v = (v << 7) | u64::from(byte & 0x7f);
        if byte & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

/// Serial type and body length of an integer, the smallest SQLite would pick.
fn int_serial(v: i64) -> (u64, usize) {
    match v {
        0 => (8, 0),
        1 => (9, 0),
        -128..=127 => (1, 1),
        -32_768..=32_767 => (2, 2),
        -8_388_608..=8_388_607 => (3, 3),
        -2_147_483_648..=2_147_483_647 => (4, 4),
        -140_737_488_355_328..=140_737_488_355_327 => (5, 6),
        _ => (6, 8),
    }
}

fn serial(c: &Col<'_>) -> u64 {
    match *c {
        Col::Int(v) => int_serial(v).0,
        Col::Text(s) => 13 + 2 * s.len() as u64,
    }
}

/// Appends the record (header, then bodies) of `cols` to `out`.
pub fn encode_record(cols: &[Col<'_>], out: &mut Vec<u8>) {
    // The header is built on the stack; under 128 bytes (every row of ours) its own length is
    // one byte. This runs for every row, so it avoids growing `out` piece by piece.
    let mut header = [0u8; 128];
    let mut len = 1;
    let mut body = 0;
    for c in cols {
        let (t, n) = match *c {
            Col::Int(v) => {
                let (t, n) = int_serial(v);
                (t, n)
            }
            Col::Text(s) => (13 + 2 * s.len() as u64, s.len()),
        };
        body += n;
        if len + 9 > header.len() {
            return encode_long_record(cols, out);
        }
        if t < 0x80 {
            header[len] = t as u8;
            len += 1;
        } else if t < 0x4000 {
            header[len] = (t >> 7) as u8 | 0x80;
            header[len + 1] = t as u8 & 0x7f;
            len += 2;
        } else {
            let mut v = Vec::with_capacity(9);
            put_varint(&mut v, t);
            header[len..len + v.len()].copy_from_slice(&v);
            len += v.len();
        }
    }
    if len >= 0x80 {
        return encode_long_record(cols, out);
    }
    header[0] = len as u8;
    out.reserve(len + body);
    out.extend_from_slice(&header[..len]);
    write_bodies(cols, out);
}

/// [`encode_record`] for headers of 128 bytes or more.
fn encode_long_record(cols: &[Col<'_>], out: &mut Vec<u8>) {
    let mut types = Vec::new();
    for c in cols {
        put_varint(&mut types, serial(c));
    }
    let mut len = types.len() + 1;
    while varint_len(len as u64) + types.len() != len {
        len = types.len() + varint_len(len as u64);
    }
    put_varint(out, len as u64);
    out.extend_from_slice(&types);
    write_bodies(cols, out);
}

fn write_bodies(cols: &[Col<'_>], out: &mut Vec<u8>) {
    for c in cols {
        match *c {
            Col::Int(v) => {
                let (_, len) = int_serial(v);
                out.extend_from_slice(&v.to_be_bytes()[8 - len..]);
            }
            Col::Text(s) => out.extend_from_slice(s.as_bytes()),
        }
    }
}

/// Where a table leaf cell of payload `p` keeps its first bytes: all of them, or the local part
/// before an overflow chain.
fn local_size(usable: usize, p: usize) -> usize {
    let max_local = usable - 35;
    if p <= max_local {
        return p;
    }
    let min_local = (usable - 12) * 32 / 255 - 23;
    let k = min_local + (p - min_local) % (usable - 4);
    if k <= max_local {
        k
    } else {
        min_local
    }
}

fn be16(b: &[u8], at: usize) -> usize {
    usize::from(u16::from_be_bytes([b[at], b[at + 1]]))
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Cell content offsets are 16 bits; 65536 (an empty 64 KiB page) is written as 0.
fn put_offset(page: &mut [u8], at: usize, v: usize) {
    page[at..at + 2].copy_from_slice(&((v & 0xffff) as u16).to_be_bytes());
}

const LEAF: u8 = 0x0d;
const INTERIOR: u8 = 0x05;

/// A table leaf page being filled from its end.
struct Leaf {
    page: Vec<u8>,
    cells: usize,
    /// Start of the cell content area.
    content: usize,
    last_rowid: i64,
}

impl Leaf {
    fn new(size: usize) -> Self {
        let mut leaf = Self { page: vec![0; size], cells: 0, content: size, last_rowid: 0 };
        leaf.clear();
        leaf
    }

    /// Only the header is cleared: the rest is either rewritten or outside the page's cells,
    /// where SQLite never reads (zeroing 64 KiB per leaf showed in the profile).
    fn clear(&mut self) {
        self.page[..8].fill(0);
        self.page[0] = LEAF;
        self.cells = 0;
        self.content = self.page.len();
        put_offset(&mut self.page, 5, self.content);
    }

    fn fits(&self, cell_len: usize) -> bool {
        8 + 2 * (self.cells + 1) + cell_len <= self.content
    }

    /// Adds a cell whose bytes are `parts` back to back (the caller checked [`Leaf::fits`]).
    fn push(&mut self, parts: &[&[u8]], rowid: i64) {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        self.content -= len;
        let mut at = self.content;
        for p in parts {
            self.page[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        let ptr = 8 + 2 * self.cells;
        put_offset(&mut self.page, ptr, self.content);
        self.cells += 1;
        put_offset(&mut self.page, 3, self.cells);
        put_offset(&mut self.page, 5, self.content);
        self.last_rowid = rowid;
    }
}

/// Where built pages go.
pub trait PageWriter {
    type Error;
    /// A page of the transaction, through the pager (and the WAL).
    fn write(&mut self, pgno: u32, page: &[u8]) -> Result<(), Self::Error>;
    /// A page no one has seen: allocated in this transaction, past the file's committed end,
    /// and never to be written again. It may bypass the pager (see [`super::bulk`]); returns
    /// whether it did.
    fn write_new(&mut self, pgno: u32, page: &[u8]) -> Result<bool, Self::Error>;
}

/// A table's shape as [`TableBuilder::resume`] found it on disk.
pub struct Found {
    /// Leaves left to right, each with an upper bound of its rowids.
    leaves: Vec<(u32, i64)>,
    interiors: Vec<u32>,
}

/// Pages the last [`TableBuilder::seal`] wrote, and the ones it no longer needs.
#[derive(Debug, PartialEq, Eq)]
pub struct Sealed {
    /// The highest page number the table may now use: the file's page count.
    pub page_count: u32,
    /// Interior pages of an earlier shape that no B-tree references any more; the caller must put
    /// them on the freelist.
    pub unused: Vec<u32>,
}

/// Builds an append-only rowid table whose root page is fixed (`CREATE TABLE` allocated it).
pub struct TableBuilder {
    usable: usize,
    root: u32,
    /// The page holding the pending byte (offset 2^30), which SQLite never uses.
    pending: u32,
    next_pgno: u32,
    next_rowid: i64,
    /// Full leaves: page number and last rowid.
    leaves: Vec<(u32, i64)>,
    leaf: Leaf,
    /// The page of the partial leaf, once it has needed one (it is the root while alone).
    leaf_pgno: Option<u32>,
    /// That page went through the pager (a seal wrote it), so it must again when it fills.
    leaf_in_wal: bool,
    /// The highest pages written through the pager and past it since the last seal.
    wal_max: u32,
    direct_max: u32,
    /// Pages used for interior nodes below the root, reused at every seal.
    pool: Vec<u32>,
    /// The leaf completed last, kept until the next one completes.
    last_full: Vec<u8>,
    record: Vec<u8>,
    head: Vec<u8>,
    interior: Vec<u8>,
}

/// The page number that holds byte offset `pending_byte`.
pub fn pending_page(pending_byte: u64, page_size: usize) -> u32 {
    (pending_byte / page_size as u64 + 1) as u32
}

impl TableBuilder {
    /// A builder for an empty table at `root` in a file of `page_count` pages.
    pub fn new(page_size: usize, root: u32, page_count: u32, pending: u32) -> Self {
        Self {
            usable: page_size,
            root,
            pending,
            next_pgno: page_count + 1,
            next_rowid: 1,
            leaves: Vec::new(),
            leaf: Leaf::new(page_size),
            leaf_pgno: None,
            leaf_in_wal: false,
            wal_max: 0,
            direct_max: 0,
            pool: Vec::new(),
            last_full: vec![0; page_size],
            record: Vec::with_capacity(512),
            head: Vec::with_capacity(32),
            interior: vec![0; page_size],
        }
    }

    /// Pages others may have added since the last seal: new pages go after `page_count`.
    pub fn set_page_count(&mut self, page_count: u32) {
        self.next_pgno = self.next_pgno.max(page_count + 1);
    }

    fn alloc(&mut self) -> u32 {
        if self.next_pgno == self.pending {
            self.next_pgno += 1;
        }
        self.next_pgno += 1;
        self.next_pgno - 1
    }

    /// Gives the builder a page of an earlier shape of the table, as a resume would.
    #[cfg(test)]
    pub fn spare_interior(&mut self) {
        let p = self.alloc();
        self.pool.push(p);
    }

    /// Appends a row; returns its rowid. Full leaves and overflow pages are written at once.
    pub fn append<W: PageWriter>(&mut self, cols: &[Col<'_>], out: &mut W) -> Result<i64, W::Error> {
        let rowid = self.next_rowid;
        self.next_rowid += 1;
        let mut record = std::mem::take(&mut self.record);
        record.clear();
        encode_record(cols, &mut record);
        let result = self.push_record(rowid, &record, out);
        self.record = record;
        result.map(|()| rowid)
    }

    fn push_record<W: PageWriter>(&mut self, rowid: i64, record: &[u8], out: &mut W) -> Result<(), W::Error> {
        let local = local_size(self.usable, record.len());
        let overflow = if local < record.len() { Some(self.write_overflow(&record[local..], out)?) } else { None };
        self.head.clear();
        put_varint(&mut self.head, record.len() as u64);
        put_varint(&mut self.head, rowid as u64);
        let cell_len = self.head.len() + local + if overflow.is_some() { 4 } else { 0 };
        if !self.leaf.fits(cell_len) {
            self.complete_leaf(out)?;
        }
        match overflow {
            None => self.leaf.push(&[&self.head, record], rowid),
            Some(first) => self.leaf.push(&[&self.head, &record[..local], &first.to_be_bytes()], rowid),
        }
        Ok(())
    }

    /// Writes `rest` as an overflow chain; returns its first page.
    fn write_overflow<W: PageWriter>(&mut self, rest: &[u8], out: &mut W) -> Result<u32, W::Error> {
        let chunk = self.usable - 4;
        let pgnos: Vec<u32> = (0..rest.len().div_ceil(chunk)).map(|_| self.alloc()).collect();
        let mut page = vec![0u8; self.usable];
        for (i, part) in rest.chunks(chunk).enumerate() {
            page.fill(0);
            let next = pgnos.get(i + 1).copied().unwrap_or(0);
            page[..4].copy_from_slice(&next.to_be_bytes());
            page[4..4 + part.len()].copy_from_slice(part);
            let direct = out.write_new(pgnos[i], &page)?;
            self.note_written(pgnos[i], direct);
        }
        Ok(pgnos[0])
    }

    fn complete_leaf<W: PageWriter>(&mut self, out: &mut W) -> Result<(), W::Error> {
        let pgno = match self.leaf_pgno {
            Some(p) => p,
            None => self.alloc(),
        };
        if self.leaf_in_wal {
            out.write(pgno, &self.leaf.page)?;
            self.wal_max = self.wal_max.max(pgno);
        } else {
            let direct = out.write_new(pgno, &self.leaf.page)?;
            self.note_written(pgno, direct);
        }
        self.leaf_pgno = None;
        self.leaf_in_wal = false;
        self.leaves.push((pgno, self.leaf.last_rowid));
        // Kept: a seal right after this may need the rows back (see `seal`).
        std::mem::swap(&mut self.leaf.page, &mut self.last_full);
        self.leaf.clear();
        Ok(())
    }

    fn note_written(&mut self, pgno: u32, direct: bool) {
        let max = if direct { &mut self.direct_max } else { &mut self.wal_max };
        *max = (*max).max(pgno);
    }

    /// Takes the last full leaf back as the partial one.
    fn reopen_last_leaf(&mut self) {
        let (pgno, last_rowid) = self.leaves.pop().expect("called with a full leaf");
        std::mem::swap(&mut self.leaf.page, &mut self.last_full);
        let page = &self.leaf.page;
        let content = be16(page, 5);
        self.leaf.cells = be16(page, 3);
        self.leaf.content = if content == 0 { page.len() } else { content };
        self.leaf.last_rowid = last_rowid;
        self.leaf_pgno = Some(pgno);
    }

    /// Writes the partial leaf and every interior page, so the table on disk holds every row
    /// appended so far.
    pub fn seal<W: PageWriter>(&mut self, out: &mut W) -> Result<Sealed, W::Error> {
        if self.leaf.cells == 0 && self.leaves.len() == 1 {
            // A root over one leaf would have no cell, which SQLite reads as corrupt: that leaf's
            // rows go back into the root instead.
            self.reopen_last_leaf();
        }
        if self.leaves.is_empty() {
            out.write(self.root, &self.leaf.page)?;
            let mut unused = std::mem::take(&mut self.pool);
            unused.extend(self.leaf_pgno.take());
            self.leaf_in_wal = false;
            return Ok(self.sealed(unused));
        }
        let mut level = self.leaves.clone();
        if self.leaf.cells > 0 {
            let pgno = match self.leaf_pgno {
                Some(p) => p,
                None => {
                    let p = self.alloc();
                    self.leaf_pgno = Some(p);
                    p
                }
            };
            out.write(pgno, &self.leaf.page)?;
            self.wal_max = self.wal_max.max(pgno);
            self.leaf_in_wal = true;
            level.push((pgno, self.leaf.last_rowid));
        }
        let mut used = 0;
        // The children an interior page surely holds: a cell is at most a 4-byte page number,
        // a 9-byte key and a 2-byte pointer.
        let cap = (self.usable - 12) / 15 + 1;
        while level.len() > cap {
            let groups = level.len().div_ceil(cap);
            let (base, extra) = (level.len() / groups, level.len() % groups);
            let mut next = Vec::with_capacity(groups);
            let mut at = 0;
            for g in 0..groups {
                let n = base + usize::from(g < extra);
                if used == self.pool.len() {
                    let p = self.alloc();
                    self.pool.push(p);
                }
                let node = self.pool[used];
                used += 1;
                self.write_interior(node, &level[at..at + n], out)?;
                next.push((node, level[at + n - 1].1));
                at += n;
            }
            level = next;
        }
        self.write_interior(self.root, &level, out)?;
        let unused = self.pool.split_off(used);
        Ok(self.sealed(unused))
    }

    /// The seal's result. The pager counts a transaction's pages up to the last one written
    /// through it, and a checkpoint truncates the file there: when the last page is one written
    /// past it, one more page (for the freelist, written through the pager) must follow.
    fn sealed(&mut self, mut unused: Vec<u32>) -> Sealed {
        if self.direct_max > self.wal_max {
            unused.push(self.alloc());
        }
        self.direct_max = 0;
        self.wal_max = 0;
        Sealed { page_count: self.next_pgno - 1, unused }
    }

    fn write_interior<W: PageWriter>(
        &mut self,
        pgno: u32,
        children: &[(u32, i64)],
        out: &mut W,
    ) -> Result<(), W::Error> {
        let page = &mut self.interior;
        page.fill(0);
        page[0] = INTERIOR;
        let (last, cells) = children.split_last().expect("an interior node has children");
        page[8..12].copy_from_slice(&last.0.to_be_bytes());
        let mut content = page.len();
        let mut cell = Vec::with_capacity(13);
        for (i, (child, key)) in cells.iter().enumerate() {
            cell.clear();
            cell.extend_from_slice(&child.to_be_bytes());
            put_varint(&mut cell, *key as u64);
            content -= cell.len();
            page[content..content + cell.len()].copy_from_slice(&cell);
            put_offset(page, 12 + 2 * i, content);
        }
        put_offset(page, 3, cells.len());
        put_offset(page, 5, content);
        out.write(pgno, page)?;
        self.wal_max = self.wal_max.max(pgno);
        Ok(())
    }

    /// Reads the shape of the table at `root` (after SQL changed it: rows updated in place, leaves
    /// split), so appending can go on. `read` returns a page's bytes.
    pub fn find(root: u32, mut read: impl FnMut(u32) -> Vec<u8>) -> Result<Found, BtreeError> {
        let mut found = Found { leaves: Vec::new(), interiors: Vec::new() };
        let depth = leaf_depth(root, &mut read)?;
        walk(root, i64::MAX, depth, &mut read, &mut found)?;
        found.interiors.retain(|&p| p != root);
        Ok(found)
    }

    /// A builder that goes on appending to the table `found` describes: its last leaf is re-packed
    /// as the partial leaf (so space SQL left free in it is used), and its interior pages are
    /// reused.
    pub fn resume(
        page_size: usize,
        root: u32,
        page_count: u32,
        pending: u32,
        found: Found,
        last_leaf: &[u8],
    ) -> Result<Self, BtreeError> {
        let mut b = Self::new(page_size, root, page_count, pending);
        let Found { mut leaves, interiors } = found;
        let (last, _) = leaves.pop().expect("a walk finds at least the root");
        b.repack(last, last_leaf)?;
        if b.leaf.cells == 0 && last != root {
            return Err(BtreeError::Malformed { pgno: last, what: "an empty leaf that is not the root" });
        }
        b.leaves = leaves;
        b.pool = interiors;
        b.leaf_pgno = (last != root).then_some(last);
        b.leaf_in_wal = true;
        // The last leaf holds the largest rowid; only an empty table has no rows to go by.
        b.next_rowid = if b.leaf.cells > 0 { b.leaf.last_rowid + 1 } else { 1 };
        Ok(b)
    }

    /// The page a resume must re-pack: the table's last leaf.
    pub fn last_leaf(found: &Found) -> u32 {
        found.leaves.last().expect("a walk finds at least the root").0
    }

    fn repack(&mut self, pgno: u32, page: &[u8]) -> Result<(), BtreeError> {
        let bad = |what| BtreeError::Malformed { pgno, what };
        if page.len() != self.usable {
            return Err(bad("wrong size"));
        }
        let hdr = if pgno == 1 { 100 } else { 0 };
        if page[hdr] != LEAF {
            return Err(BtreeError::NotTablePage { pgno, kind: page[hdr] });
        }
        for i in 0..be16(page, hdr + 3) {
            let at = be16(page, hdr + 8 + 2 * i);
            let (p, n1) = get_varint(page.get(at..).ok_or(bad("cell pointer"))?).ok_or(bad("cell"))?;
            let (rowid, n2) = get_varint(&page[at + n1..]).ok_or(bad("cell"))?;
            let p = usize::try_from(p).map_err(|_| bad("payload size"))?;
            let local = local_size(self.usable, p);
            let len = n1 + n2 + local + if local < p { 4 } else { 0 };
            let cell = page.get(at..at + len).ok_or(bad("cell past the page"))?;
            if !self.leaf.fits(len) {
                return Err(bad("cells overlap"));
            }
            self.leaf.push(&[cell], rowid as i64);
        }
        Ok(())
    }
}

/// The children of interior page `pgno`, each with the upper bound of its keys (`bound` for the
/// rightmost).
fn children(pgno: u32, page: &[u8], bound: i64) -> Result<Vec<(u32, i64)>, BtreeError> {
    let bad = |what| BtreeError::Malformed { pgno, what };
    let hdr = if pgno == 1 { 100 } else { 0 };
    match page.get(hdr).copied() {
        Some(INTERIOR) => {}
        Some(kind) => return Err(BtreeError::NotTablePage { pgno, kind }),
        None => return Err(bad("empty page")),
    }
    let cells = be16(page, hdr + 3);
    let mut out = Vec::with_capacity(cells + 1);
    for i in 0..cells {
        let at = be16(page, hdr + 12 + 2 * i);
        let cell = page.get(at..).filter(|c| c.len() > 4).ok_or(bad("cell pointer"))?;
        let (key, _) = get_varint(&cell[4..]).ok_or(bad("cell"))?;
        out.push((be32(cell, 0), key as i64));
    }
    out.push((be32(page, hdr + 8), bound));
    Ok(out)
}

const MAX_DEPTH: usize = 8;

/// How many interior levels are above the leaves (all leaves are at one depth), reading only
/// the leftmost path.
fn leaf_depth(root: u32, read: &mut impl FnMut(u32) -> Vec<u8>) -> Result<usize, BtreeError> {
    let mut pgno = root;
    for depth in 0..=MAX_DEPTH {
        let page = read(pgno);
        let hdr = if pgno == 1 { 100 } else { 0 };
        match page.get(hdr).copied() {
            Some(LEAF) => return Ok(depth),
            Some(INTERIOR) => pgno = children(pgno, &page, i64::MAX)?[0].0,
            Some(kind) => return Err(BtreeError::NotTablePage { pgno, kind }),
            None => return Err(BtreeError::Malformed { pgno, what: "empty page" }),
        }
    }
    Err(BtreeError::TooDeep(MAX_DEPTH))
}

/// Depth-first over the interior pages, collecting them and the leaves below them (with the
/// bound their parent gives) in key order. Leaves are not read.
fn walk(
    pgno: u32,
    bound: i64,
    levels_left: usize,
    read: &mut impl FnMut(u32) -> Vec<u8>,
    found: &mut Found,
) -> Result<(), BtreeError> {
    if levels_left == 0 {
        found.leaves.push((pgno, bound));
        return Ok(());
    }
    found.interiors.push(pgno);
    let page = read(pgno);
    for (child, key) in children(pgno, &page, bound)? {
        walk(child, key, levels_left - 1, read, found)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_match_the_file_formats_examples() {
        // https://sqlite.org/fileformat2.html: one byte below 0x80, two up to 0x3fff, nine bytes
        // with a full last byte at the top.
        for (v, bytes) in [
            (0u64, vec![0x00]),
            (0x7f, vec![0x7f]),
            (0x80, vec![0x81, 0x00]),
            (0x3fff, vec![0xff, 0x7f]),
            (0x4000, vec![0x81, 0x80, 0x00]),
            (u64::MAX, vec![0xff; 9]),
        ] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            assert_eq!(out, bytes, "{v:#x}");
            assert_eq!(varint_len(v), bytes.len());
            assert_eq!(get_varint(&bytes), Some((v, bytes.len())));
        }
        for shift in 0..64 {
            let v = 1u64 << shift | 0x55;
            let mut out = Vec::new();
            put_varint(&mut out, v);
            assert_eq!(get_varint(&out), Some((v, out.len())), "{v:#x}");
        }
    }

    #[test]
    fn the_pending_page_is_never_allocated() {
        let mut b = TableBuilder::new(512, 2, 3, 5);
        let pages: Vec<u32> = (0..4).map(|_| b.alloc()).collect();
        assert_eq!(pages, [4, 6, 7, 8]);
    }
}
