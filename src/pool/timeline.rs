//! Renders a pool's event log as an SVG timeline of the address space: time runs left to
//! right, addresses bottom to top, and each mapping is a box from its map to its unmap.
//!
//! Tenants' reservations lie far apart in the 48-bit address space, so each is drawn as its own
//! band, stacked in registration order, with addresses measured from the band's base. Boxes of
//! chunks reused from the cache are lighter than fresh ones; a red line marks each drain.

use std::collections::HashMap;
use std::path::Path;

use plotters::prelude::*;

use super::events::{Event, EventKind};
use super::ledger::TenantId;
use crate::error::{Error, PoolError, Result};

const MIB: f64 = (1u64 << 20) as f64;

/// One mapping's life: `[start, end)` in ms, `[low, high)` in MiB on the stacked axis.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MappingBox {
    /// The tenant whose band the box is drawn in.
    pub tenant: TenantId,
    /// When the chunk was mapped, in ms from the first event shown.
    pub start: f64,
    /// When it was unmapped (or the last event, if it is still mapped), in ms.
    pub end: f64,
    /// Its lowest address on the stacked axis, in MiB.
    pub low: f64,
    /// Its end address on the stacked axis, in MiB.
    pub high: f64,
    /// Whether the chunk came from the cache (drawn lighter).
    pub reused: bool,
}

/// The shapes of a timeline, worked out from events; what [`render_svg`] draws.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TimelineShapes {
    /// Tenants in band order: id, name, band base and top on the stacked axis (MiB).
    pub bands: Vec<(TenantId, String, f64, f64)>,
    /// Every mapping's box: those unmapped in the order they were, then those still mapped by
    /// address.
    pub boxes: Vec<MappingBox>,
    /// When each drain happened, in ms.
    pub drains: Vec<f64>,
    /// Time of the last event, in ms from the first: the right edge of the picture.
    pub end_ms: f64,
}

struct Band {
    base_address: u64,
    capacity: usize,
    axis_base: f64,
}

impl TimelineShapes {
    /// Pairs each map with the unmap at the same address; mappings still live at the end are
    /// drawn to the last event. Events of tenants whose registration was dropped from the log
    /// are skipped, since their band is unknown.
    pub fn from_events<'a>(events: impl IntoIterator<Item = &'a Event>) -> Self {
        let events: Vec<&Event> = events.into_iter().collect();
        // Time runs from the first event shown, not from the pool's creation.
        let origin = events.first().map_or(0.0, |e| ms(e.at));
        let end_ms = events.last().map_or(0.0, |e| ms(e.at) - origin);
        let mut shapes = TimelineShapes {
            end_ms,
            ..Self::default()
        };
        let mut bands: HashMap<TenantId, Band> = HashMap::new();
        let mut open: HashMap<u64, (TenantId, f64, bool, usize)> = HashMap::new();
        let mut axis_top = 0.0;
        for event in events {
            let at = ms(event.at) - origin;
            match (&event.kind, event.tenant) {
                (EventKind::Register { name }, Some(tenant)) => {
                    let gap = if bands.is_empty() {
                        0.0
                    } else {
                        axis_top * 0.02 + 1.0
                    };
                    let axis_base = axis_top + gap;
                    axis_top = axis_base + event.bytes as f64 / MIB;
                    bands.insert(
                        tenant,
                        Band {
                            base_address: event.address,
                            capacity: event.bytes,
                            axis_base,
                        },
                    );
                    shapes
                        .bands
                        .push((tenant, name.to_string(), axis_base, axis_top));
                }
                (EventKind::Map { reused, .. }, Some(tenant)) if bands.contains_key(&tenant) => {
                    open.insert(event.address, (tenant, at, *reused, event.bytes));
                }
                (EventKind::Unmap { .. }, _) => {
                    if let Some((tenant, start, reused, bytes)) = open.remove(&event.address) {
                        shapes.push_box(&bands, tenant, event.address, bytes, start, at, reused);
                    }
                }
                (EventKind::Drain { .. }, _) => shapes.drains.push(at),
                _ => {}
            }
        }
        let mut still_mapped: Vec<_> = open.into_iter().collect();
        still_mapped.sort_by_key(|(address, _)| *address);
        for (address, (tenant, start, reused, bytes)) in still_mapped {
            shapes.push_box(&bands, tenant, address, bytes, start, end_ms, reused);
        }
        shapes
    }

    #[allow(clippy::too_many_arguments)]
    fn push_box(
        &mut self,
        bands: &HashMap<TenantId, Band>,
        tenant: TenantId,
        address: u64,
        bytes: usize,
        start: f64,
        end: f64,
        reused: bool,
    ) {
        let Some(band) = bands.get(&tenant) else {
            return;
        };
        let offset = address.saturating_sub(band.base_address) as f64 / MIB;
        let low = band.axis_base + offset.min(band.capacity as f64 / MIB);
        self.boxes.push(MappingBox {
            tenant,
            start,
            end,
            low,
            high: low + bytes as f64 / MIB,
            reused,
        });
    }

    fn axis_top(&self) -> f64 {
        self.bands.iter().map(|b| b.3).fold(0.0, f64::max)
    }
}

fn ms(at: std::time::Duration) -> f64 {
    at.as_secs_f64() * 1e3
}

fn render_error(error: impl std::fmt::Display) -> Error {
    Error::Pool(PoolError::Timeline(error.to_string()))
}

/// Draws `events` as an SVG timeline titled `title` and returns the SVG text.
pub fn render_svg<'a>(events: impl IntoIterator<Item = &'a Event>, title: &str) -> Result<String> {
    let shapes = TimelineShapes::from_events(events);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1280, 720)).into_drawing_area();
        root.fill(&WHITE).map_err(render_error)?;
        let x_max = (shapes.end_ms * 1.02).max(1e-3);
        let y_max = (shapes.axis_top() * 1.02).max(1.0);
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(84)
            .build_cartesian_2d(0f64..x_max, 0f64..y_max)
            .map_err(render_error)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_max_light_lines(0)
            .x_label_formatter(&|ms| format!("{ms:.0}"))
            .y_label_formatter(&|mib| format!("{mib:.0}"))
            .x_desc("time since the first event (ms)")
            .y_desc("address: MiB from each tenant's base, bands stacked")
            .draw()
            .map_err(render_error)?;

        for (index, (tenant, name, low, high)) in shapes.bands.iter().enumerate() {
            let color = Palette99::pick(index).to_rgba();
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(0.0, *low), (x_max, *high)],
                    color.mix(0.06).filled(),
                )))
                .map_err(render_error)?;
            let boxes: Vec<_> = shapes
                .boxes
                .iter()
                .filter(|b| b.tenant == *tenant)
                .collect();
            chart
                .draw_series(boxes.iter().map(|b| {
                    let alpha = if b.reused { 0.45 } else { 0.9 };
                    // At least a sliver wide, so short-lived mappings stay visible.
                    let end = b.end.max(b.start + x_max * 1e-3);
                    Rectangle::new([(b.start, b.low), (end, b.high)], color.mix(alpha).filled())
                }))
                .map_err(render_error)?
                .label(format!("{name} ({} mappings)", boxes.len()))
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled())
                });
        }
        if !shapes.drains.is_empty() {
            chart
                .draw_series(
                    shapes.drains.iter().map(|&t| {
                        PathElement::new(vec![(t, 0.0), (t, y_max)], RED.stroke_width(2))
                    }),
                )
                .map_err(render_error)?
                .label("drain: cached chunks released")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], RED.stroke_width(2)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(render_error)?;
        root.present().map_err(render_error)?;
    }
    Ok(svg)
}

/// [`render_svg`], written to `path`.
pub fn write_svg<'a>(
    events: impl IntoIterator<Item = &'a Event>,
    title: &str,
    path: impl AsRef<Path>,
) -> Result<()> {
    let svg = render_svg(events, title)?;
    std::fs::write(path, svg).map_err(|source| Error::Io {
        call: "write",
        source,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::pool::events::{BlockId, DrainReason};
    use crate::pool::ledger::ChunkId;

    const M: usize = 1 << 20;

    fn at(ms: u64, kind: EventKind, tenant: u32, address: u64, bytes: usize) -> Event {
        Event {
            at: Duration::from_millis(ms),
            kind,
            tenant: Some(TenantId(tenant)),
            address,
            bytes,
        }
    }

    fn sample() -> Vec<Event> {
        let map = |chunk, reused| EventKind::Map {
            chunk: ChunkId(chunk),
            block: BlockId(1),
            reused,
        };
        let unmap = |chunk| EventKind::Unmap {
            chunk: ChunkId(chunk),
            block: BlockId(1),
        };
        vec![
            at(
                0,
                EventKind::Register {
                    name: Arc::from("llm"),
                },
                1,
                0x1000_0000,
                64 * M,
            ),
            at(
                1,
                EventKind::Register {
                    name: Arc::from("rl"),
                },
                2,
                0x9000_0000,
                32 * M,
            ),
            at(2, map(0, false), 1, 0x1000_0000, 4 * M),
            at(3, map(1, false), 2, 0x9000_0000 + 8 * M as u64, 2 * M),
            at(5, unmap(0), 1, 0x1000_0000, 4 * M),
            at(
                6,
                EventKind::Drain {
                    chunks: 1,
                    reason: DrainReason::Budget,
                },
                1,
                0,
                4 * M,
            ),
            at(7, map(0, true), 1, 0x1000_0000 + 16 * M as u64, 4 * M),
            at(9, EventKind::Refused, 1, 0, 0),
        ]
    }

    #[test]
    fn maps_pair_with_unmaps_and_stack_into_bands() {
        let shapes = TimelineShapes::from_events(&sample());
        assert_eq!(shapes.bands.len(), 2);
        let (_, ref name, base, top) = shapes.bands[1];
        assert_eq!(name, "rl");
        assert!(base > 64.0 && (top - base - 32.0).abs() < 1e-9);
        assert_eq!(shapes.boxes.len(), 3);
        let closed = shapes.boxes.iter().find(|b| b.end == 5.0).unwrap();
        assert_eq!((closed.start, closed.low, closed.high), (2.0, 0.0, 4.0));
        let reused = shapes.boxes.iter().find(|b| b.reused).unwrap();
        assert_eq!(
            (reused.low, reused.end),
            (16.0, 9.0),
            "still mapped: drawn to the end"
        );
        let rl = shapes
            .boxes
            .iter()
            .find(|b| b.tenant == TenantId(2))
            .unwrap();
        assert!((rl.low - base - 8.0).abs() < 1e-9);
        assert_eq!(shapes.drains, vec![6.0]);
    }

    #[test]
    fn renders_an_svg_with_one_box_per_mapping() {
        let svg = render_svg(&sample(), "test timeline").unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("test timeline"));
        assert!(svg.contains("llm (2 mappings)") && svg.contains("rl (1 mappings)"));
        assert!(svg.contains("drain"));
        // Background, two band tints, three boxes, and the legend's swatches at least.
        assert!(svg.matches("<rect").count() >= 6);
    }

    #[test]
    fn an_empty_log_still_renders() {
        let svg = render_svg(&[], "empty").unwrap();
        assert!(svg.contains("empty"));
    }
}
