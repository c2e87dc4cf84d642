use super::*;
use crate::apis::Api;
use crate::model::{AccessKind, DriverInfo, MstxKind, Origin, PageType, Pool, Space};

/// The row of `output`, which it borrows (kept for the test's life).
fn to_row(output: Output) -> Row<'static> {
    super::to_row(Box::leak(Box::new(output))).expect("a row")
}

fn site(api: Api) -> Site {
    Site::of(api, 5, 1, 2)
}

#[test]
fn device_malloc_is_hal_with_insight_keys() {
    let r = to_row(Output::Malloc {
        site: site(Api::AclrtMalloc),
        device: DeviceKey::Npu(1),
        space: Space::Device,
        ptr: 0xabc,
        size: 512,
        allocation_id: 3,
        used: 1024,
        origin: Origin::Direct { policy: Some(0), module: None, driver: None },
        req_size: 512,
        owner: Some("CANN@UNKNOWN@x".into()),
        segment: Some(Pool::Caching),
        from: Default::default(),
    });
    assert_eq!((r.head.event.as_str(), r.head.event_type.as_str(), r.name.as_ref()), ("MALLOC", "HAL", "aclrtMalloc"));
    assert_eq!(r.ptr_text(), "0x0000000000000abc");
    assert_eq!(r.device_id(), "1");
    for key in ["addr", "size", "allocation_id", "used"] {
        assert!(r.attr.get(key).is_some(), "missing {key}");
    }
    assert_eq!(r.attr.get("size").as_deref(), Some("512"));
    assert_eq!(r.attr.get("owner").as_deref(), Some("CANN@UNKNOWN@x"));
    assert_eq!(r.attr.get("segment").as_deref(), Some("caching"));
}

#[test]
fn a_malloc_whose_tail_repeats_the_last_ones_is_written_the_same_as_on_its_own() {
    let driver = |size| DriverInfo {
        api: Api::HalMemAlloc,
        flag: Some(0x2100_0000_0000_0400),
        size,
        module: Some(33),
        page: Some(PageType::Normal),
    };
    let malloc = |ptr: u64, size: u64, owner: &str| Output::Malloc {
        site: site(Api::AclrtMalloc),
        device: DeviceKey::Npu(0),
        space: Space::Device,
        ptr,
        size,
        req_size: size - 32,
        allocation_id: ptr,
        used: size,
        origin: Origin::Direct { policy: Some(0), module: None, driver: Some(driver(size)) },
        owner: Some(owner.into()),
        segment: None,
        from: Default::default(),
    };
    let tail = |owner: &str| {
        format!(
            r#""policy":"0","module_id":"33","hal_api":"halMemAlloc","flag":"0x2100000000000400","page_type":"normal","alloc_type":"alloc","owner":"{owner}"}}"#
        )
    };
    let mut batch = crate::store::Batch::default();
    for (ptr, size, owner) in
        [(1, 4128, "CANN@APP"), (2, 4160, "CANN@APP"), (3, 4160, "CANN@APP@x\"y"), (4, 64, "CANN@APP")]
    {
        batch.clear();
        assert!(batch.push_output(&malloc(ptr, size, owner), (crate::stacks::NO_STACK, crate::stacks::NO_STACK), &[]));
        let json = batch.get(0).attr.to_owned();
        let head = format!(
            r#"{{"addr":"0x{ptr:016x}","size":"{size}","req_size":"{}","allocation_id":"{ptr}","api":"aclrtMalloc","used":"{size}","#,
            size - 32
        );
        let escaped = owner.replace('"', "\\\"");
        assert_eq!(json, head + &tail(&escaped), "row {ptr}");
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["owner"], owner);
    }
}

/// A 1024-byte pool block asked for as 1000 bytes.
fn pool_block(pool: Pool, weight: Option<u64>) -> Output {
    Output::PoolMalloc {
        site: Site { weight, ..site(Api::DeviceCachingAllocatorMalloc) },
        device: DeviceKey::Npu(0),
        pool,
        ptr: 0x200,
        size: 1024,
        req_size: Some(1000),
        stream: Some(0x5a00),
        allocation_id: 1,
        used: 1024,
        total: 2 << 20,
        owner: crate::model::tracker::OwnerBase::Pool(pool).label(),
        from: Default::default(),
    }
}

#[test]
fn pool_blocks_are_pta_with_counters_and_owner() {
    for (pool, owner) in [(Pool::Caching, "PTA"), (Pool::Workspace, "PTA_WORKSPACE")] {
        let r = to_row(pool_block(pool, None));
        assert_eq!((r.head.event.as_str(), r.head.event_type.as_str()), ("MALLOC", "PTA"));
        assert_eq!(r.attr.get("owner").as_deref(), Some(owner));
        assert_eq!(r.attr.get("pool").as_deref(), Some(pool.as_str()));
        assert_eq!(r.attr.get("used").as_deref(), Some("1024"));
        assert_eq!(r.attr.get("total").as_deref(), Some("2097152"));
        assert_eq!(r.attr.get("req_size").as_deref(), Some("1000"));
        assert_eq!(r.attr.get("stream").as_deref(), Some("0x0000000000005a00"));
    }
}

/// docs/db-schema.md "Sampled rows": weight = k × N × size / req_size; an exact row has none.
#[test]
fn a_sampled_pool_block_carries_its_weight_scaled_from_its_request_to_its_size() {
    let block = |weight| pool_block(Pool::Caching, weight);
    // Two points of a 512 KiB interval in a 1000-byte request, for a 1024-byte block.
    assert_eq!(to_row(block(Some(2 << 19))).attr.get("weight").as_deref(), Some("1073741"));
    assert_eq!(to_row(block(None)).attr.get("weight"), None);
}

#[test]
fn free_carries_size_and_shadow_mark() {
    let free = |shadow, implied| Output::Free {
        site: site(Api::AclrtFree),
        device: DeviceKey::Npu(0),
        space: Space::Device,
        ptr: 0x1,
        size: Some(64),
        allocation_id: Some(1),
        used: 0,
        shadow,
        implied,
        driver: None,
    };
    let r = to_row(free(true, false));
    assert_eq!((r.head.event.as_str(), r.head.event_type.as_str()), ("FREE", "HAL"));
    assert_eq!(r.attr.get("size").as_deref(), Some("64"));
    assert_eq!(r.attr.get("shadow").as_deref(), Some("true"));
    assert_eq!(r.attr.get("implied"), None);
    assert!(r.head.shadow && !r.head.untracked);
    // A block a closed window forgot: a real row, marked.
    let r = to_row(free(false, true));
    assert_eq!((r.attr.get("implied").as_deref(), r.attr.get("shadow")), (Some("true"), None));
    assert!(!r.head.shadow && !r.head.untracked);
}

#[test]
fn pinned_host_blocks_are_host_pinned_and_cpu_tensors_host() {
    let host = |api, space| Output::Malloc {
        site: site(api),
        device: DeviceKey::Cpu,
        space,
        ptr: 0x1,
        size: 1,
        allocation_id: 1,
        used: 1,
        origin: Origin::Direct { policy: None, module: None, driver: None },
        req_size: 1,
        owner: Some("HOST".into()),
        segment: None,
        from: Default::default(),
    };
    let pinned = to_row(host(Api::AclrtMallocHost, Space::Host));
    assert_eq!(
        (pinned.head.event_type.as_str(), pinned.device_id().as_str()),
        ("HOST_PINNED", "cpu"),
        "msMemScope's name"
    );
    assert_eq!(pinned.attr.get("pinned").as_deref(), Some("true"));
    let tensor = to_row(host(Api::C10AllocCpu, Space::Cpu));
    assert_eq!(
        (tensor.head.event_type.as_str(), tensor.attr.get("pinned")),
        ("HOST", None),
        "a CPU tensor is not pinned"
    );
}

#[test]
fn a_free_of_a_block_never_seen_is_kept_out_of_insights_table() {
    let free = |size| Output::Free {
        site: site(Api::AclrtFree),
        device: DeviceKey::Npu(0),
        space: Space::Device,
        ptr: 0x1,
        size,
        allocation_id: size.map(|_| 1),
        used: 0,
        shadow: false,
        implied: false,
        driver: None,
    };
    assert!(is_untracked_free(&to_row(free(None))));
    assert!(!is_untracked_free(&to_row(free(Some(8)))));
}

#[test]
fn steps_and_marks_are_broadcast_rows_in_msmemscope_names() {
    let step = to_row(Output::Step { wall_ns: 9, pid: 1, tid: 2, number: 3, inferred: false });
    assert_eq!(
        (step.head.event.as_str(), step.head.event_type.as_str(), step.name.as_ref(), step.head.broadcast),
        ("SYSTEM", "STEP", "3", true)
    );
    let kind = MstxKind::RangeStart;
    let start =
        to_row(Output::Mstx { wall_ns: 9, pid: 1, tid: 2, api: None, kind, id: Some(4), message: "fwd".into() });
    assert_eq!(
        (start.head.event.as_str(), start.head.event_type.as_str(), start.name.as_ref()),
        ("MSTX", "Range_start", "\"fwd\"")
    );
    let kind = MstxKind::RangeEnd;
    let end = to_row(Output::Mstx { wall_ns: 9, pid: 1, tid: 2, api: None, kind, id: Some(4), message: String::new() });
    assert_eq!(end.name.as_ref(), "Range end from id 4");
    assert!(super::to_row(&Output::Retag {
        device: DeviceKey::Npu(0),
        pid: 1,
        event_type: EventType::Pta,
        ptr: 1,
        owner: "PTA@x".into(),
        by: crate::model::OwnerBy::Marker,
    })
    .is_none());
}

#[test]
fn operators_are_broadcast_op_launch_rows_and_their_tensors_accesses() {
    let start = to_row(Output::OpLaunch { wall_ns: 9, pid: 1, tid: 2, start: true, name: "aten.mm.default".into() });
    assert_eq!(
        (
            start.head.event.as_str(),
            start.head.event_type.as_str(),
            start.name.as_ref(),
            start.head.broadcast,
            start.ptr_text().as_str()
        ),
        ("OP_LAUNCH", "ATEN_START", "aten.mm.default", true, "N/A")
    );
    let end = to_row(Output::OpLaunch { wall_ns: 9, pid: 1, tid: 2, start: false, name: String::new() });
    assert_eq!((end.head.event_type.as_str(), end.name.as_ref()), ("ATEN_END", "N/A"));

    let access = |kind, pool, op: Option<&str>, desc: Option<&str>| {
        to_row(Output::OpAccess {
            wall_ns: 9,
            pid: 1,
            tid: 2,
            device: DeviceKey::Npu(0),
            block_type: EventType::Pta,
            block: 0x1000,
            allocation_id: 4,
            pool,
            addr: 0x1010,
            size: 128,
            kind,
            op: op.map(str::to_owned),
            desc: desc.map(str::to_owned),
        })
    };
    let r = access(AccessKind::Read, Some(Pool::Caching), Some("aten.mm.default"), Some("float32[4,8]"));
    assert_eq!(
        (r.head.event.as_str(), r.head.event_type.as_str(), r.name.as_ref(), r.head.broadcast),
        ("ACCESS", "READ", "aten.mm.default", false)
    );
    assert_eq!((r.ptr_text().as_str(), r.device_id().as_str()), ("0x0000000000001010", "0"));
    assert_eq!(
        r.attr.to_json(),
        r#"{"allocation_id":"4","addr":"0x0000000000001010","size":"128","type":"PTA","block":"0x0000000000001000","dtype":"float32","shape":"[4,8]"}"#
    );
    let w = access(AccessKind::Write, None, None, Some("opaque"));
    assert_eq!((w.head.event_type.as_str(), w.name.as_ref()), ("WRITE", "N/A"));
    assert_eq!((w.attr.get("type").as_deref(), w.attr.get("tensor").as_deref()), (Some("PTA"), Some("opaque")));
    assert_eq!(w.attr.get("dtype"), None);
}

#[test]
fn atb_operations_are_op_launch_rows_on_their_device_with_the_workspace() {
    let launch = |start: bool, status| {
        to_row(Output::AtbLaunch {
            site: Site { wall_ns: if start { 4 } else { 5 }, ..site(Api::AtbRunnerExecute) },
            device: DeviceKey::Npu(1),
            start,
            runner: 0x55,
            workspace: Some(0x9000),
            workspace_size: Some(1 << 20),
            intermediate_size: Some(3 << 20),
            status,
        })
    };
    let start = launch(true, None);
    assert_eq!(
        (
            start.head.event.as_str(),
            start.head.event_type.as_str(),
            start.name.as_ref(),
            start.head.ts_ns,
            start.head.broadcast
        ),
        ("OP_LAUNCH", "ATB_START", "atb::Runner::Execute", 4, false)
    );
    assert_eq!((start.device_id().as_str(), start.ptr_text().as_str()), ("1", "N/A"));
    assert_eq!(
        start.attr.to_json(),
        r#"{"workspace_ptr":"0x0000000000009000","workspace_size":"1048576","intermediate_size":"3145728","runner":"0x0000000000000055"}"#
    );
    let end = launch(false, Some(0));
    assert_eq!(
        (end.head.event_type.as_str(), end.head.ts_ns, end.attr.get("status").as_deref()),
        ("ATB_END", 5, Some("0"))
    );
    assert_eq!(end.attr.get("workspace_size").as_deref(), Some("1048576"));
}

#[test]
fn out_of_memory_is_an_oom_trigger_and_other_errors_are_api_errors() {
    let oom = to_row(Output::Failed {
        site: site(Api::AclrtMalloc),
        device: DeviceKey::Npu(0),
        status: 207_001,
        out_of_memory: true,
        size: Some(10),
        ptr: None,
        driver: None,
        segment: None,
    });
    assert_eq!((oom.head.event.as_str(), oom.head.event_type.as_str()), ("OOM_DETAIL", "OOM_TRIGGER"));
    assert_eq!(oom.attr.get("req_size").as_deref(), Some("10"));
    assert_eq!(oom.ptr_text(), "N/A");
    let err = to_row(Output::Failed {
        site: site(Api::AclrtFree),
        device: DeviceKey::Npu(0),
        status: 100_000,
        out_of_memory: false,
        size: None,
        ptr: Some(0x5),
        driver: None,
        segment: None,
    });
    assert_eq!((err.head.event.as_str(), err.head.event_type.as_str()), ("API_ERROR", "HAL"));
}
