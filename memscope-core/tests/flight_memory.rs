//! The flight recorder's memory, measured by the heap itself: a counting allocator sees every
//! byte the window and its feed take. The bounds checked are those docs/metrics.md states (and
//! the daemon's memory test adds up): per row or block the window keeps, and per live block the
//! feed's own tracker follows under sampling.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};

use memscope_core::apis::Api;
use memscope_core::ingest::flight::{Feed, Limits, BLOCK_BYTES, ROW_BYTES, TRACKED_BYTES};
use memscope_core::model::{Call, Event, EventKind, Op, Pool};
use memscope_core::stacks::NO_STACK;

struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);

// SAFETY: forwards to the system allocator, only counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: the caller's layout, as given.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: a block this allocator handed out, with its layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        // SAFETY: as in `alloc` and `dealloc`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// A tensor block of torch_npu's caching pool, on its own address.
fn pool_malloc(i: u64) -> Event {
    let op = Op::PoolMalloc {
        pool: Pool::Caching,
        ptr: Some(0x1_0000_0000 + i * 0x1000),
        size: Some(4096),
        req: Some(4000),
        device: Some(0),
        handle: None,
        stream: None,
    };
    let wall_ns = 1_000_000 + i * 100;
    Event {
        wall_ns,
        pid: 7,
        tid: 7,
        kind: EventKind::Call(Call {
            api: Api::DeviceCachingAllocatorMalloc,
            entry_wall_ns: wall_ns - 50,
            status: 0,
            out_of_memory: false,
            outer: None,
            thread_device: Some(0),
            op,
            stack: NO_STACK,
            py_stack: NO_STACK,
            sample_weight: None,
            window_only: true,
            caller: None,
        }),
    }
}

/// Its free.
fn pool_free(i: u64) -> Event {
    let mut e = pool_malloc(i);
    e.wall_ns += 50;
    if let EventKind::Call(c) = &mut e.kind {
        c.api = Api::DeviceCachingAllocatorFree;
        c.op = Op::PoolFree {
            pool: Pool::Caching,
            ptr: Some(0x1_0000_0000 + i * 0x1000),
            handle: None,
            size: Some(4096),
            device: Some(0),
        };
    }
    e
}

fn live() -> i64 {
    LIVE.load(Ordering::Relaxed)
}

/// One test: the allocator counts every thread's bytes, and the test harness's own are few and
/// settled before each measure.
#[test]
fn the_window_and_its_feed_keep_within_their_stated_bytes() {
    let limits = Limits { recent: 20_000, held: 50_000 };
    let kept = (limits.recent + limits.held) as i64;
    let before = live();
    let mut feed = Feed::new(limits);
    for i in 0..kept as u64 {
        feed.on_event(&pool_malloc(i));
    }
    let full = live() - before;
    // Past the bounds the window keeps its size; the feed's tracker follows every live block.
    let extra = 200_000;
    for i in kept as u64..kept as u64 + extra {
        feed.on_event(&pool_malloc(i));
    }
    let tracked = (live() - before - full) as f64 / extra as f64;
    assert_eq!(feed.window.len(), (limits.recent, limits.held));
    assert_eq!(feed.window.dropped().held, extra);
    let per_kept = (full as f64 - tracked * kept as f64) / kept as f64;
    println!("flight recorder: {per_kept:.0} bytes per row or block kept, {tracked:.0} per live block tracked");
    assert!(tracked <= TRACKED_BYTES as f64, "{tracked:.0} bytes per tracked block, over {TRACKED_BYTES}");
    assert!(per_kept <= BLOCK_BYTES.max(ROW_BYTES) as f64, "{per_kept:.0} bytes per kept row, over {BLOCK_BYTES}");

    // Rows alone (blocks freed at once, as a training step's are): recent rows, nothing held,
    // nothing tracked.
    drop(feed);
    let events: Vec<Event> = (0..25_000u64).flat_map(|i| [pool_malloc(i), pool_free(i)]).collect();
    let before = live();
    let mut feed = Feed::new(Limits { recent: 50_000, held: 10 });
    for e in &events {
        feed.on_event(e);
    }
    assert_eq!(feed.window.len(), (50_000, 0));
    let per_row = (live() - before) as f64 / 50_000.0;
    println!("flight recorder: {per_row:.0} bytes per recent row");
    assert!(per_row <= ROW_BYTES as f64, "{per_row:.0} bytes per recent row, over {ROW_BYTES}");
}
