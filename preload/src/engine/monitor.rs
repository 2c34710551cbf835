//! Monitor mode's record of allocations, and the timeline events built from it.
//!
//! Everything here is plain data: the at-exit handler renders the SVG from these records and
//! never calls CUDA (the runtime may already have torn its context down by then).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use stablebuf::pool::{human_bytes, BlockId, ChunkId, Event, EventKind, TenantId};

/// Allocations closer than this share one band of the timeline.
pub const BAND_GAP: u64 = 1 << 30;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    Alloc,
    Free,
}

/// One allocation or free the layer saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    pub at: Duration,
    pub kind: RecordKind,
    pub call: &'static str,
    pub address: u64,
    pub bytes: usize,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallCount {
    pub calls: u64,
    pub bytes: u64,
}

/// Allocations seen in monitor mode, bounded in memory.
#[derive(Debug)]
pub struct MonitorLog {
    capacity: usize,
    records: Vec<Record>,
    dropped: u64,
    live: BTreeMap<u64, (usize, &'static str)>,
    live_bytes: usize,
    peak_live_bytes: usize,
    calls: BTreeMap<&'static str, CallCount>,
    unknown_frees: u64,
}

impl MonitorLog {
    /// Keeps up to `capacity` records for the timeline (counts go on past it).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            records: Vec::new(),
            dropped: 0,
            live: BTreeMap::new(),
            live_bytes: 0,
            peak_live_bytes: 0,
            calls: BTreeMap::new(),
            unknown_frees: 0,
        }
    }

    fn push(&mut self, record: Record) {
        if self.records.len() < self.capacity {
            self.records.push(record);
        } else {
            self.dropped += 1;
        }
    }

    pub fn alloc(&mut self, at: Duration, call: &'static str, address: u64, bytes: usize) {
        let count = self.calls.entry(call).or_default();
        count.calls += 1;
        count.bytes += bytes as u64;
        if let Some((old, _)) = self.live.insert(address, (bytes, call)) {
            // The same address again without a free we saw (freed by a path we do not hook).
            self.live_bytes -= old;
        }
        self.live_bytes += bytes;
        self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes);
        self.push(Record {
            at,
            kind: RecordKind::Alloc,
            call,
            address,
            bytes,
        });
    }

    /// Records a free; returns the allocation's size if it was seen.
    pub fn free(&mut self, at: Duration, call: &'static str, address: u64) -> Option<usize> {
        self.calls.entry(call).or_default().calls += 1;
        let Some((bytes, _)) = self.live.remove(&address) else {
            self.unknown_frees += 1;
            return None;
        };
        self.live_bytes -= bytes;
        self.push(Record {
            at,
            kind: RecordKind::Free,
            call,
            address,
            bytes,
        });
        Some(bytes)
    }

    pub fn records(&self) -> &[Record] {
        &self.records
    }

    pub fn calls(&self) -> &BTreeMap<&'static str, CallCount> {
        &self.calls
    }

    pub fn live(&self) -> (usize, usize) {
        (self.live.len(), self.live_bytes)
    }

    pub fn peak_live_bytes(&self) -> usize {
        self.peak_live_bytes
    }

    pub fn count(&self, call: &str) -> u64 {
        self.calls.get(call).map_or(0, |c| c.calls)
    }

    pub fn unknown_frees(&self) -> u64 {
        self.unknown_frees
    }

    /// The one-line summary printed at exit.
    pub fn summary(&self) -> String {
        let calls: Vec<String> = self
            .calls
            .iter()
            .map(|(call, count)| {
                if count.bytes > 0 {
                    format!(
                        "{call} {} ({})",
                        count.calls,
                        human_bytes(count.bytes as usize)
                    )
                } else {
                    format!("{call} {}", count.calls)
                }
            })
            .collect();
        let mut line = format!(
            "stablebuf-preload monitor: {}; peak live {}; still live {} in {} allocations",
            if calls.is_empty() {
                "no allocation seen".to_string()
            } else {
                calls.join(", ")
            },
            human_bytes(self.peak_live_bytes),
            human_bytes(self.live_bytes),
            self.live.len(),
        );
        if self.unknown_frees > 0 {
            line.push_str(&format!(
                "; {} frees of pointers not seen allocated",
                self.unknown_frees
            ));
        }
        if self.dropped > 0 {
            line.push_str(&format!(
                "; {} records beyond the timeline's capacity",
                self.dropped
            ));
        }
        line
    }

    /// The records as pool events: one band per cluster of addresses ([`bands`]), a map at each
    /// allocation and an unmap at each free, so the pool's renderer draws them.
    pub fn events(&self) -> Vec<Event> {
        let ranges: Vec<(u64, u64)> = self
            .records
            .iter()
            .filter(|r| r.kind == RecordKind::Alloc)
            .map(|r| (r.address, r.address.saturating_add(r.bytes as u64)))
            .collect();
        let bands = bands(&ranges, BAND_GAP);
        let band_of = |address: u64| {
            let index = bands.partition_point(|&(start, _)| start <= address);
            TenantId(index.max(1) as u32)
        };
        let mut events: Vec<Event> = bands
            .iter()
            .enumerate()
            .map(|(index, &(start, end))| Event {
                at: Duration::ZERO,
                kind: EventKind::Register {
                    name: Arc::from(format!("device memory near {start:#x}")),
                },
                tenant: Some(TenantId(index as u32 + 1)),
                address: start,
                bytes: (end - start) as usize,
            })
            .collect();
        for (index, record) in self.records.iter().enumerate() {
            let chunk = ChunkId(index as u32);
            let block = BlockId(index as u64);
            let kind = match record.kind {
                RecordKind::Alloc => EventKind::Map {
                    chunk,
                    block,
                    reused: false,
                },
                RecordKind::Free => EventKind::Unmap { chunk, block },
            };
            events.push(Event {
                at: record.at,
                kind,
                tenant: Some(band_of(record.address)),
                address: record.address,
                bytes: record.bytes,
            });
        }
        events
    }
}

/// Merges `[start, end)` ranges into bands: ranges closer than `gap` share a band. Sorted by
/// start, disjoint.
pub fn bands(ranges: &[(u64, u64)], gap: u64) -> Vec<(u64, u64)> {
    let mut sorted: Vec<(u64, u64)> = ranges.to_vec();
    sorted.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (start, end) in sorted {
        match merged.last_mut() {
            Some(last) if start <= last.1.saturating_add(gap) => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    merged
}

/// Events of several logs (pools of several devices, regions) on one clock: each source's
/// events are shifted by its `offset` from the common origin, its tenants renumbered from
/// `tenant_base` so bands never collide, and all sorted by time (stable).
pub fn merge_events(sources: Vec<(Duration, u32, Vec<Event>)>) -> Vec<Event> {
    let mut all: Vec<Event> = sources
        .into_iter()
        .flat_map(|(offset, tenant_base, events)| {
            events.into_iter().map(move |mut event| {
                event.at += offset;
                event.tenant = event.tenant.map(|t| TenantId(tenant_base + t.0));
                event
            })
        })
        .collect();
    all.sort_by_key(|e| e.at);
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn counts_live_bytes_and_peak() {
        let mut log = MonitorLog::new(100);
        log.alloc(ms(1), "cudaMalloc", 0x1000_0000, 64 * MIB);
        log.alloc(ms(2), "cuMemAlloc_v2", 0x2000_0000, 32 * MIB);
        assert_eq!(log.free(ms(3), "cudaFree", 0x1000_0000), Some(64 * MIB));
        assert_eq!(
            log.free(ms(4), "cudaFree", 0xdead),
            None,
            "not seen allocated"
        );
        assert_eq!(log.live(), (1, 32 * MIB));
        assert_eq!(log.peak_live_bytes(), 96 * MIB);
        assert_eq!(log.count("cudaMalloc"), 1);
        assert_eq!(log.count("cudaFree"), 2);
        assert_eq!(log.unknown_frees(), 1);
        let summary = log.summary();
        assert!(summary.contains("cudaMalloc 1 (64.00 MiB)"), "{summary}");
        assert!(summary.contains("cuMemAlloc_v2 1 (32.00 MiB)"), "{summary}");
        assert!(summary.contains("peak live 96.00 MiB"), "{summary}");
        assert!(
            summary.contains("1 frees of pointers not seen"),
            "{summary}"
        );
    }

    #[test]
    fn records_stop_at_capacity_but_counts_go_on() {
        let mut log = MonitorLog::new(2);
        for n in 0..5u64 {
            log.alloc(ms(n), "cudaMalloc", n << 32, MIB);
        }
        assert_eq!(log.records().len(), 2);
        assert_eq!(log.count("cudaMalloc"), 5);
        assert!(log.summary().contains("3 records beyond"));
    }

    #[test]
    fn bands_merge_near_ranges_only() {
        let gap = 1 << 30;
        let ranges = [
            (0x7000_0000_0000, 0x7000_0400_0000),
            (0x7000_0800_0000, 0x7000_0900_0000), // 64 MiB later: same band
            (0x7100_0000_0000, 0x7100_0001_0000), // a TiB away: new band
            (0x7000_0100_0000, 0x7000_0200_0000), // inside the first
        ];
        assert_eq!(
            bands(&ranges, gap),
            vec![
                (0x7000_0000_0000, 0x7000_0900_0000),
                (0x7100_0000_0000, 0x7100_0001_0000)
            ]
        );
        assert!(bands(&[], gap).is_empty());
    }

    #[test]
    fn events_draw_one_box_per_allocation_in_its_band() {
        let mut log = MonitorLog::new(100);
        let far = 0x7100_0000_0000u64;
        log.alloc(ms(1), "cudaMalloc", 0x7000_0000_0000, 64 * MIB);
        log.alloc(ms(2), "cudaMalloc", far, 2 * MIB);
        log.free(ms(3), "cudaFree", 0x7000_0000_0000);
        let events = log.events();
        let registers: Vec<_> = events
            .iter()
            .filter(|e| matches!(e.kind, EventKind::Register { .. }))
            .collect();
        assert_eq!(registers.len(), 2);
        let maps: Vec<_> = events
            .iter()
            .filter(|e| matches!(e.kind, EventKind::Map { .. }))
            .collect();
        assert_eq!(maps.len(), 2);
        assert_eq!(
            maps[1].tenant,
            Some(TenantId(2)),
            "the far allocation has its own band"
        );
        let unmap = events
            .iter()
            .find(|e| matches!(e.kind, EventKind::Unmap { .. }))
            .unwrap();
        assert_eq!(
            (unmap.address, unmap.tenant),
            (0x7000_0000_0000, Some(TenantId(1)))
        );
        let svg = stablebuf::pool::timeline::render_svg(&events, "monitor").unwrap();
        assert!(svg.contains("(1 mappings)"), "one box in each band");
    }

    #[test]
    fn merged_events_share_one_clock_and_keep_bands_apart() {
        let event = |at: u64, tenant: u32| Event {
            at: ms(at),
            kind: EventKind::Refused,
            tenant: Some(TenantId(tenant)),
            address: 0,
            bytes: 0,
        };
        let merged = merge_events(vec![
            (ms(0), 0, vec![event(5, 1), event(20, 1)]),
            (ms(10), 1000, vec![event(0, 1), event(1, 2)]),
        ]);
        let seen: Vec<(u128, u32)> = merged
            .iter()
            .map(|e| (e.at.as_millis(), e.tenant.unwrap().0))
            .collect();
        assert_eq!(seen, vec![(5, 1), (10, 1001), (11, 1002), (20, 1)]);
    }
}
