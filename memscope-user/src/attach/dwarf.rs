//! Struct layouts from DWARF, for probes that read fields of a returned or passed object.
//!
//! torch_npu's `DeviceCachingAllocator::malloc` returns a `Block*` and `free` takes one; where the
//! block's address, size and device sit inside `Block` changes between versions, so the offsets
//! are taken from the library's own debug information rather than assumed.

use std::borrow::Cow;

use gimli::{AttributeValue, EndianSlice, RunTimeEndian};
use object::{Object, ObjectSection};

/// Byte offsets of `members` in the first struct named `name` (inside a namespace whose name is
/// `namespace`, when given) that has all of them. `None` if there is no such struct.
pub fn member_offsets(data: &[u8], namespace: Option<&str>, name: &str, members: &[&str]) -> Option<Vec<u64>> {
    let file = object::File::parse(data).ok()?;
    let endian = if file.is_little_endian() { RunTimeEndian::Little } else { RunTimeEndian::Big };
    let load = |id: gimli::SectionId| -> Result<Cow<'_, [u8]>, gimli::Error> {
        Ok(file.section_by_name(id.name()).and_then(|s| s.uncompressed_data().ok()).unwrap_or(Cow::Borrowed(&[])))
    };
    let sections = gimli::DwarfSections::load(load).ok()?;
    let dwarf = sections.borrow(|s| EndianSlice::new(s, endian));
    let mut units = dwarf.units();
    while let Ok(Some(header)) = units.next() {
        let Ok(unit) = dwarf.unit(header) else { continue };
        if let Some(found) = search_unit(&dwarf, &unit, namespace, name, members) {
            return Some(found);
        }
    }
    None
}

type Slice<'a> = EndianSlice<'a, RunTimeEndian>;

fn die_name(
    dwarf: &gimli::Dwarf<Slice<'_>>,
    unit: &gimli::Unit<Slice<'_>>,
    entry: &gimli::DebuggingInformationEntry<Slice<'_>>,
) -> Option<String> {
    let value = entry.attr_value(gimli::DW_AT_name).ok()??;
    let s = dwarf.attr_string(unit, value).ok()?;
    Some(s.to_string_lossy().into_owned())
}

fn search_unit(
    dwarf: &gimli::Dwarf<Slice<'_>>,
    unit: &gimli::Unit<Slice<'_>>,
    namespace: Option<&str>,
    name: &str,
    members: &[&str],
) -> Option<Vec<u64>> {
    let mut entries = unit.entries();
    // Names of the enclosing namespaces, by depth.
    let mut scopes: Vec<Option<String>> = Vec::new();
    let mut depth: isize = 0;
    while let Ok(Some((delta, entry))) = entries.next_dfs() {
        depth += delta;
        scopes.truncate(usize::try_from(depth).unwrap_or(0));
        let tag = entry.tag();
        let entry_name = die_name(dwarf, unit, entry);
        scopes.push(if tag == gimli::DW_TAG_namespace { entry_name.clone().or(Some(String::new())) } else { None });
        if tag != gimli::DW_TAG_structure_type && tag != gimli::DW_TAG_class_type {
            continue;
        }
        if entry_name.as_deref() != Some(name) {
            continue;
        }
        let in_namespace = namespace.is_none_or(|ns| scopes.iter().flatten().any(|s| s == ns));
        if !in_namespace || entry.attr_value(gimli::DW_AT_declaration).ok().flatten().is_some() {
            continue;
        }
        if let Some(offsets) = struct_members(dwarf, unit, entry.offset(), members) {
            return Some(offsets);
        }
    }
    None
}

fn struct_members(
    dwarf: &gimli::Dwarf<Slice<'_>>,
    unit: &gimli::Unit<Slice<'_>>,
    offset: gimli::UnitOffset,
    members: &[&str],
) -> Option<Vec<u64>> {
    let mut tree = unit.entries_tree(Some(offset)).ok()?;
    let root = tree.root().ok()?;
    let mut children = root.children();
    let mut found = vec![None; members.len()];
    while let Ok(Some(child)) = children.next() {
        let entry = child.entry();
        if entry.tag() != gimli::DW_TAG_member {
            continue;
        }
        let Some(name) = die_name(dwarf, unit, entry) else { continue };
        let Some(i) = members.iter().position(|m| *m == name) else { continue };
        let location = match entry.attr_value(gimli::DW_AT_data_member_location).ok()? {
            Some(AttributeValue::Udata(v)) => v,
            Some(AttributeValue::Data1(v)) => v.into(),
            Some(AttributeValue::Data2(v)) => v.into(),
            Some(AttributeValue::Data4(v)) => v.into(),
            Some(AttributeValue::Data8(v)) => v,
            Some(AttributeValue::Sdata(v)) => u64::try_from(v).ok()?,
            _ => continue,
        };
        found[i] = Some(location);
    }
    found.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::process::Command;

    use memscope_core::apis::atb;

    /// A struct of this test binary, checked against the compiler's own layout.
    #[repr(C)]
    pub struct MemscopeDwarfProbe {
        pub device: i32,
        pub stream: u64,
        pub size: u64,
        pub ptr: *mut u8,
    }

    #[test]
    fn finds_member_offsets_in_this_test_binary() {
        // Keep the type alive in the binary's DWARF.
        let probe = MemscopeDwarfProbe { device: 1, stream: 2, size: 3, ptr: std::ptr::null_mut() };
        std::hint::black_box(&probe);
        let data = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let got = super::member_offsets(&data, None, "MemscopeDwarfProbe", &["ptr", "size", "device"]);
        let want = vec![
            std::mem::offset_of!(MemscopeDwarfProbe, ptr) as u64,
            std::mem::offset_of!(MemscopeDwarfProbe, size) as u64,
            std::mem::offset_of!(MemscopeDwarfProbe, device) as u64,
        ];
        assert_eq!(got, Some(want));
        assert_eq!(super::member_offsets(&data, None, "MemscopeDwarfProbe", &["no_such_member"]), None);
        assert_eq!(super::member_offsets(&data, Some("no_such_namespace"), "MemscopeDwarfProbe", &["ptr"]), None);
    }

    /// The fallback offsets are the layout of ATB's declarations as a compiler lays them out:
    /// the stand-in header mirrors them member for member. Skipped without a C++ compiler.
    #[test]
    fn fallback_offsets_match_the_declarations_compiled() {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        let header = root.join("tests/standin/atb/atb_standin.h");
        let dir = std::env::temp_dir().join(format!("memscope-atb-layout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let source = dir.join("pack.cpp");
        // Linked, not a relocatable object: the DWARF reader does not apply relocations.
        let object = dir.join("libpack.so");
        std::fs::write(
            &source,
            format!(
                "#include \"{}\"\natb::RunnerVariantPack *keep_pack_type() {{ return nullptr; }}\n",
                header.display()
            ),
        )
        .unwrap();
        let Ok(status) = Command::new("g++")
            .args(["-std=c++17", "-g", "-fno-eliminate-unused-debug-types", "-shared", "-fPIC", "-o"])
            .arg(&object)
            .arg(&source)
            .status()
        else {
            eprintln!("no g++: skipped");
            return;
        };
        assert!(status.success(), "the stand-in ATB header does not compile");
        let data = std::fs::read(&object).unwrap();
        let l = &atb::RUNNER_VARIANT_PACK;
        let found = super::member_offsets(&data, Some(l.namespace), l.name, l.members);
        assert_eq!(found, Some(atb::FALLBACK_OFFSETS.to_vec()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
