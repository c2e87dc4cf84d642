//! Sizes as users write them on command lines (`512KiB`, `2GiB`), for every verb that takes one.

/// `1048576`, `512KiB`, `1MiB`, `2GiB` (`K`/`M`/`G`/`T` too): bytes.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" | "KB" => 1 << 10,
        "M" | "MiB" | "MB" => 1 << 20,
        "G" | "GiB" | "GB" => 1 << 30,
        "T" | "TiB" | "TB" => 1 << 40,
        _ => return Err(format!("`{text}` is not a size (examples: 1048576, 512KiB, 1MiB, 2GiB)")),
    };
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .ok_or_else(|| format!("`{text}` is not a size (examples: 1048576, 512KiB, 1MiB, 2GiB)"))
}
