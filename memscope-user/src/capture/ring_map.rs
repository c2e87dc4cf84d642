//! The BPF ring buffer's pages, mapped into the tracer once.
//!
//! The kernel lets a consumer map the data pages twice in a row, so that a record wrapping past
//! the end reads as one slice, and aya's `RingBuf` does so. The tracer's RSS counts both
//! mappings: a 32 MiB ring would cost 64 MiB of it. Here the data pages are mapped once, and the
//! few records that wrap (one per trip round the ring at most) are copied into a scratch buffer.
//! The protocol is the kernel's (`kernel/bpf/ringbuf.c`): a consumer position page we write, a
//! producer position page and the data pages read-only, and an 8-byte header before each record
//! whose length word carries a busy bit (reserved, not yet submitted) and a discard bit.

use std::io;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::atomic::{fence, AtomicU32, AtomicUsize, Ordering};

use aya::maps::{MapData, MapError};
use memmap2::{Mmap, MmapMut, MmapOptions};
use thiserror::Error;

const HEADER: usize = 8;
const BUSY: u32 = 1 << 31;
const DISCARD: u32 = 1 << 30;

#[derive(Debug, Error)]
pub enum RingMapError {
    #[error("cannot read the ring buffer map's size")]
    Info(#[source] MapError),
    #[error("the ring buffer's {size} bytes are not a power-of-two number of pages")]
    Size { size: usize },
    #[error("cannot map the ring buffer's pages")]
    Mmap(#[source] io::Error),
}

pub struct RingMap {
    /// Keeps the descriptor the mappings and the poll use.
    map: MapData,
    /// The consumer position, the one page of the map we may write.
    consumer: MmapMut,
    /// The producer position page, then the data pages (once).
    producer: Mmap,
    page: usize,
    size: usize,
    /// Where the next record's header is (a position that only grows; the offset is masked).
    pos: usize,
    wrapped: Vec<u8>,
}

/// What the next header says.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    /// Reserved but not submitted yet: read again on the next drain.
    Busy,
    /// A record (discarded or not) whose header and body take `step` bytes of the ring.
    Record { start: usize, len: usize, discarded: bool, step: usize },
}

/// Reads the header at ring position `pos` of `data` (the data pages, a power of two long).
fn next(data: &[u8], pos: usize) -> Next {
    let at = pos & (data.len() - 1);
    // SAFETY: headers are 8-byte aligned inside the page-aligned data, so 4 bytes at `at` are in
    // bounds and aligned; the kernel writes the word atomically.
    let word = unsafe { &*data.as_ptr().add(at).cast::<AtomicU32>() }.load(Ordering::Acquire);
    if word & BUSY != 0 {
        return Next::Busy;
    }
    let len = (word & !(BUSY | DISCARD)) as usize;
    Next::Record {
        start: (at + HEADER) & (data.len() - 1),
        len,
        discarded: word & DISCARD != 0,
        step: (HEADER + len).next_multiple_of(8),
    }
}

/// The record's bytes: in place, or copied into `wrapped` when they run past the end.
fn body<'a>(data: &'a [u8], start: usize, len: usize, wrapped: &'a mut Vec<u8>) -> &'a [u8] {
    let len = len.min(data.len());
    if start + len <= data.len() {
        return &data[start..start + len];
    }
    let first = data.len() - start;
    wrapped.clear();
    wrapped.extend_from_slice(&data[start..]);
    wrapped.extend_from_slice(&data[..len - first]);
    wrapped
}

impl RingMap {
    pub fn new(map: MapData) -> Result<Self, RingMapError> {
        let size = map.info().map_err(RingMapError::Info)?.max_entries() as usize;
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        if !size.is_power_of_two() || !size.is_multiple_of(page) {
            return Err(RingMapError::Size { size });
        }
        let fd = map.fd().as_fd().as_raw_fd();
        // SAFETY: the map's own layout (page 0 writable, the rest read-only); the kernel keeps the
        // pages for as long as they are mapped, and other writers use atomics, as we do.
        let consumer = unsafe { MmapOptions::new().len(page).map_mut(fd) }.map_err(RingMapError::Mmap)?;
        // SAFETY: as above.
        let producer =
            unsafe { MmapOptions::new().offset(page as u64).len(page + size).map(fd) }.map_err(RingMapError::Mmap)?;
        let mut ring = Self { map, consumer, producer, page, size, pos: 0, wrapped: Vec::new() };
        ring.pos = ring.consumer_pos().load(Ordering::Acquire);
        Ok(ring)
    }

    fn consumer_pos(&self) -> &AtomicUsize {
        // SAFETY: the page starts with the kernel's `unsigned long consumer_pos`, page-aligned.
        unsafe { &*self.consumer.as_ptr().cast::<AtomicUsize>() }
    }

    fn producer_pos(&self) -> &AtomicUsize {
        // SAFETY: as above, `producer_pos`.
        unsafe { &*self.producer.as_ptr().cast::<AtomicUsize>() }
    }

    /// Calls `f` on every submitted record, in ring order, giving each one's space back to the
    /// producers right after it.
    pub fn drain(&mut self, mut f: impl FnMut(&[u8])) {
        loop {
            let producer = self.producer_pos().load(Ordering::Acquire);
            if producer == self.pos {
                return;
            }
            while self.pos != producer {
                let data = &self.producer[self.page..self.page + self.size];
                let Next::Record { start, len, discarded, step } = next(data, self.pos) else { return };
                if !discarded {
                    f(body(data, start, len, &mut self.wrapped));
                }
                self.pos = self.pos.wrapping_add(step);
                // Pairs with the kernel's acquire load before it reuses the space.
                self.consumer_pos().store(self.pos, Ordering::Release);
            }
            // Either the next load sees a record submitted meanwhile, or its producer sees the
            // position stored above.
            fence(Ordering::SeqCst);
        }
    }
}

impl AsRawFd for RingMap {
    fn as_raw_fd(&self) -> RawFd {
        self.map.fd().as_fd().as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 64-byte ring with a header written at `at`.
    fn ring_with(at: usize, word: u32) -> Vec<u8> {
        let mut data = vec![0u8; 64];
        data[at..at + 4].copy_from_slice(&word.to_ne_bytes());
        data
    }

    #[test]
    fn a_record_is_its_header_then_its_bytes_padded_to_8() {
        let data = ring_with(8, 13);
        assert_eq!(next(&data, 8), Next::Record { start: 16, len: 13, discarded: false, step: 24 });
        // Positions only grow: the offset is the position masked by the ring's size.
        assert_eq!(next(&data, 64 + 8), next(&data, 8));
    }

    #[test]
    fn busy_and_discarded_records_are_told_apart() {
        assert_eq!(next(&ring_with(0, BUSY | 16), 0), Next::Busy);
        assert_eq!(next(&ring_with(0, DISCARD | 16), 0), Next::Record { start: 8, len: 16, discarded: true, step: 24 });
    }

    #[test]
    fn a_record_that_runs_past_the_end_reads_as_one_piece() {
        let mut data: Vec<u8> = (0..64).collect();
        // A header in the last 8 bytes: its body starts at the beginning, in place.
        data[56..60].copy_from_slice(&5u32.to_ne_bytes());
        let Next::Record { start, len, .. } = next(&data, 56) else { panic!("busy") };
        let mut wrapped = Vec::new();
        assert_eq!(body(&data, start, len, &mut wrapped), &[0, 1, 2, 3, 4]);
        // A body that starts 8 bytes before the end and goes on at the start.
        let data: Vec<u8> = (0..64).collect();
        assert_eq!(body(&data, 56, 12, &mut wrapped), &[56, 57, 58, 59, 60, 61, 62, 63, 0, 1, 2, 3]);
    }
}
