//! Draws the README's charts from measured numbers:
//!
//! ```text
//! scripts/plots <results-dir> <out-dir>
//! ```
//!
//! reads three CSV files from `<results-dir>` (the committed ones are in `docs/results/`) and
//! writes one SVG per file into `<out-dir>`:
//!
//! | input | output | chart |
//! | --- | --- | --- |
//! | `bind-cost.csv` | `bind-cost.svg` | cost of pointing a graph at new bytes against their size, log-log, per method (remap, copy-in, re-capture), the remap/copy-in crossover marked |
//! | `decode-step.csv` | `decode-step.svg` | time per decode step of each variant, one bar each, with its ratio to the first row (the floor) |
//! | `pause-resume.csv` | `pause-resume.svg` | pause + resume with contents kept, per size, per tool (log scale) |
//!
//! Every file starts with `# key: value` lines; `# device:` is required and goes into each
//! chart's caption (a chart says which GPU its numbers come from), `# source:` says which run
//! produced them. Then a header line and the rows:
//!
//! ```text
//! bind-cost.csv:    method,bytes,microseconds
//! decode-step.csv:  variant,description,microseconds      (first row: the floor)
//! pause-resume.csv: bytes,tool,seconds
//! ```

use std::collections::BTreeMap;
use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use plotters::prelude::*;

type Result<T> = std::result::Result<T, String>;

const MIB: f64 = (1u64 << 20) as f64;
const GIB: f64 = (1u64 << 30) as f64;

/// One results file: its `# key: value` lines and its rows (header checked, cells trimmed).
#[derive(Debug)]
struct Table {
    name: String,
    meta: BTreeMap<String, String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn parse(name: &str, text: &str, header: &[&str]) -> Result<Table> {
        let mut meta = BTreeMap::new();
        let mut rows = Vec::new();
        let mut seen_header = false;
        for (index, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            if let Some(comment) = line.strip_prefix('#') {
                if let Some((key, value)) = comment.split_once(':') {
                    meta.insert(key.trim().to_lowercase(), value.trim().to_string());
                }
                continue;
            }
            let cells: Vec<String> = line.split(',').map(|c| c.trim().to_string()).collect();
            if !seen_header {
                if cells != header {
                    return Err(format!(
                        "{name}:{}: header is `{line}`, expected `{}`",
                        index + 1,
                        header.join(",")
                    ));
                }
                seen_header = true;
                continue;
            }
            if cells.len() != header.len() {
                return Err(format!(
                    "{name}:{}: {} cells, expected {}",
                    index + 1,
                    cells.len(),
                    header.len()
                ));
            }
            rows.push(cells);
        }
        if rows.is_empty() {
            return Err(format!("{name}: no rows"));
        }
        if !meta.contains_key("device") {
            return Err(format!(
                "{name}: no `# device: <GPU name>` line (every chart names its GPU)"
            ));
        }
        Ok(Table {
            name: name.to_string(),
            meta,
            rows,
        })
    }

    fn read(dir: &Path, name: &str, header: &[&str]) -> Result<Table> {
        let path = dir.join(name);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Table::parse(name, &text, header)
    }

    fn device(&self) -> &str {
        self.meta.get("device").map(String::as_str).unwrap_or("?")
    }

    /// Column `column` of every row as a positive number.
    fn number(&self, row: usize, column: usize) -> Result<f64> {
        let cell = &self.rows[row][column];
        match cell.parse::<f64>() {
            Ok(value) if value > 0.0 && value.is_finite() => Ok(value),
            _ => Err(format!(
                "{}: row {}: `{cell}` is not a positive number",
                self.name,
                row + 1
            )),
        }
    }
}

fn draw_error(error: impl Display) -> String {
    format!("drawing failed: {error}")
}

fn size_label(bytes: f64) -> String {
    if bytes >= GIB {
        format!("{} GiB", (bytes / GIB * 100.0).round() / 100.0)
    } else {
        format!("{} MiB", (bytes / MIB * 10.0).round() / 10.0)
    }
}

/// One method's points of the bind-cost chart, sorted by size.
type Series = Vec<(f64, f64)>;

fn bind_series(table: &Table) -> Result<BTreeMap<String, Series>> {
    let mut series: BTreeMap<String, Series> = BTreeMap::new();
    for row in 0..table.rows.len() {
        // Plotted in MiB, so the log axis ticks at 1, 10, 100 ... MiB.
        let point = (table.number(row, 1)? / MIB, table.number(row, 2)?);
        series
            .entry(table.rows[row][0].clone())
            .or_default()
            .push(point);
    }
    for points in series.values_mut() {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    Ok(series)
}

/// Where two measured cost curves cross, interpolated linearly in log-log between the two sizes
/// that both measured and whose order differs; `None` if they never change order.
fn crossover(a: &[(f64, f64)], b: &[(f64, f64)]) -> Option<f64> {
    let common: Vec<(f64, f64)> = a
        .iter()
        .filter_map(|&(size, cost)| {
            let other = b.iter().find(|p| p.0 == size)?.1;
            Some((size.ln(), (cost / other).ln()))
        })
        .collect();
    common.windows(2).find_map(|pair| {
        let ((x0, d0), (x1, d1)) = (pair[0], pair[1]);
        (d0 * d1 < 0.0).then(|| (x0 + (x1 - x0) * d0 / (d0 - d1)).exp())
    })
}

fn palette(index: usize) -> RGBColor {
    let (r, g, b) = Palette99::pick(index).to_rgba().rgb();
    RGBColor(r, g, b)
}

fn style_of(method: &str, index: usize) -> RGBColor {
    match method {
        "remap" => RGBColor(31, 119, 180),
        "copy-in" => RGBColor(214, 39, 40),
        _ if method.starts_with("re-capture") => RGBColor(44, 160, 44),
        _ => palette(index + 3),
    }
}

fn bind_cost(table: &Table, out: &Path) -> Result<()> {
    let series = bind_series(table)?;
    let all: Vec<(f64, f64)> = series.values().flatten().copied().collect();
    let (x_min, x_max) = all.iter().fold((f64::MAX, f64::MIN), |(lo, hi), p| {
        (lo.min(p.0), hi.max(p.0))
    });
    let (y_min, y_max) = all.iter().fold((f64::MAX, f64::MIN), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_error)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!(
                    "Pointing a graph at new bytes: cost against size ({})",
                    table.device()
                ),
                ("sans-serif", 20),
            )
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(70)
            .build_cartesian_2d(
                (x_min / 1.5..x_max * 1.5).log_scale(),
                (y_min / 2.0..y_max * 2.0).log_scale(),
            )
            .map_err(draw_error)?;
        chart
            .configure_mesh()
            .x_label_formatter(&|mib| size_label(*mib * MIB))
            .y_label_formatter(&|us| format!("{us}"))
            .x_desc("bytes given to the graph (log scale)")
            .y_desc("µs")
            .draw()
            .map_err(draw_error)?;
        for (index, (method, points)) in series.iter().enumerate() {
            let color = style_of(method, index);
            chart
                .draw_series(LineSeries::new(
                    points.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(draw_error)?
                .label(method.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                });
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                .map_err(draw_error)?;
        }
        if let (Some(remap), Some(copy)) = (series.get("remap"), series.get("copy-in")) {
            if let Some(at) = crossover(remap, copy) {
                let grey = RGBColor(90, 90, 90);
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        vec![(at, y_min / 2.0), (at, y_max * 2.0)],
                        grey.stroke_width(1),
                    )))
                    .map_err(draw_error)?;
                chart
                    .draw_series(std::iter::once(Text::new(
                        format!(
                            "crossover ≈ {}: below, copying is cheaper",
                            size_label(at * MIB)
                        ),
                        (at * 1.1, y_max),
                        ("sans-serif", 15).into_font().color(&grey),
                    )))
                    .map_err(draw_error)?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()
            .map_err(draw_error)?;
        root.present().map_err(draw_error)?;
    }
    write(out, "bind-cost.svg", &svg)
}

fn decode_step(table: &Table, out: &Path) -> Result<()> {
    let rows: Vec<(String, f64)> = (0..table.rows.len())
        .map(|row| {
            let label = format!("({}) {}", table.rows[row][0], table.rows[row][1]);
            Ok((label, table.number(row, 2)?))
        })
        .collect::<Result<_>>()?;
    let floor = rows[0].1;
    let longest = rows.iter().map(|r| r.1).fold(0.0, f64::max);
    let count = rows.len() as f64;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 90 + 56 * rows.len() as u32))
            .into_drawing_area();
        root.fill(&WHITE).map_err(draw_error)?;
        let workload = table.meta.get("workload").cloned().unwrap_or_default();
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!(
                    "Decode step, a new weight set every step ({})",
                    table.device()
                ),
                ("sans-serif", 20),
            )
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(8)
            .build_cartesian_2d(0f64..longest * 1.3, 0f64..count)
            .map_err(draw_error)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(0)
            .x_desc(if workload.is_empty() {
                "µs per step (median)".to_string()
            } else {
                format!("µs per step (median); {workload}")
            })
            .draw()
            .map_err(draw_error)?;
        for (index, (label, us)) in rows.iter().enumerate() {
            // The first row on top.
            let top = count - index as f64 - 0.15;
            let bottom = count - index as f64 - 0.85;
            let color = if index == 0 {
                RGBColor(150, 150, 150)
            } else if label.contains("rebind") {
                RGBColor(31, 119, 180)
            } else {
                RGBColor(214, 39, 40)
            };
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(0.0, bottom), (*us, top)],
                    color.mix(0.75).filled(),
                )))
                .map_err(draw_error)?;
            let middle = (top + bottom) / 2.0 + 0.12;
            chart
                .draw_series([
                    Text::new(
                        label.clone(),
                        (longest * 0.01, middle),
                        ("sans-serif", 15).into_font().color(&BLACK),
                    ),
                    Text::new(
                        format!("{us:.1} µs ({:.2}× floor)", us / floor),
                        (us + longest * 0.01, middle),
                        ("sans-serif", 15).into_font().color(&BLACK),
                    ),
                ])
                .map_err(draw_error)?;
        }
        root.present().map_err(draw_error)?;
    }
    write(out, "decode-step.svg", &svg)
}

fn pause_resume(table: &Table, out: &Path) -> Result<()> {
    let mut sizes: Vec<f64> = Vec::new();
    let mut tools: Vec<String> = Vec::new();
    let mut values = Vec::new();
    for row in 0..table.rows.len() {
        let (size, seconds) = (table.number(row, 0)?, table.number(row, 2)?);
        let tool = table.rows[row][1].clone();
        if !sizes.contains(&size) {
            sizes.push(size);
        }
        if !tools.contains(&tool) {
            tools.push(tool.clone());
        }
        values.push((size, tool, seconds));
    }
    sizes.sort_by(f64::total_cmp);
    let (low, high) = values.iter().fold((f64::MAX, f64::MIN), |(lo, hi), v| {
        (lo.min(v.2), hi.max(v.2))
    });
    let (y_min, y_max) = (low / 3.0, high * 3.0);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 560)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_error)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("Pause + resume, contents kept ({})", table.device()),
                ("sans-serif", 20),
            )
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..sizes.len() as f64, (y_min..y_max).log_scale())
            .map_err(draw_error)?;
        let size_names: Vec<String> = sizes.iter().map(|&s| size_label(s)).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(sizes.len() * 2 + 1)
            .x_label_formatter(&|x| {
                let slot = x.floor() as usize;
                let centred = (x - x.floor() - 0.5).abs() < 0.05;
                match size_names.get(slot) {
                    Some(name) if centred => name.clone(),
                    _ => String::new(),
                }
            })
            .y_label_formatter(&|s| format!("{s} s"))
            .x_desc("bytes paused and resumed")
            .y_desc("seconds, log scale")
            .draw()
            .map_err(draw_error)?;
        let width = 0.8 / tools.len() as f64;
        for (t, tool) in tools.iter().enumerate() {
            let color = match t {
                0 => RGBColor(31, 119, 180),
                1 => RGBColor(214, 39, 40),
                _ => palette(t + 1),
            };
            let bars: Vec<(f64, f64)> = values
                .iter()
                .filter(|v| &v.1 == tool)
                .map(|v| {
                    let slot = sizes.iter().position(|&s| s == v.0).unwrap_or(0) as f64;
                    (slot + 0.1 + width * t as f64, v.2)
                })
                .collect();
            chart
                .draw_series(bars.iter().map(|&(x, s)| {
                    Rectangle::new([(x, y_min), (x + width * 0.92, s)], color.mix(0.8).filled())
                }))
                .map_err(draw_error)?
                .label(tool.clone())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled())
                });
            chart
                .draw_series(bars.iter().map(|&(x, s)| {
                    Text::new(
                        format!("{s} s"),
                        (x + width * 0.1, s * 1.25),
                        ("sans-serif", 14).into_font().color(&BLACK),
                    )
                }))
                .map_err(draw_error)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()
            .map_err(draw_error)?;
        root.present().map_err(draw_error)?;
    }
    write(out, "pause-resume.svg", &svg)
}

fn write(dir: &Path, name: &str, svg: &str) -> Result<()> {
    let path = dir.join(name);
    std::fs::write(&path, svg).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

fn run(results: &Path, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    bind_cost(
        &Table::read(
            results,
            "bind-cost.csv",
            &["method", "bytes", "microseconds"],
        )?,
        out,
    )?;
    decode_step(
        &Table::read(
            results,
            "decode-step.csv",
            &["variant", "description", "microseconds"],
        )?,
        out,
    )?;
    pause_resume(
        &Table::read(results, "pause-resume.csv", &["bytes", "tool", "seconds"])?,
        out,
    )
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() != 2 || args.iter().any(|a| a == "-h" || a == "--help") {
        eprintln!("usage: scripts/plots <results-dir> <out-dir>   (e.g. docs/results docs)");
        return if args.iter().any(|a| a == "-h" || a == "--help") {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(2)
        };
    }
    match run(&PathBuf::from(&args[0]), &PathBuf::from(&args[1])) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("scripts/plots: {message}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BIND: &str = "# device: Test GPU\nmethod,bytes,microseconds\n\
        remap,2097152,47\nremap,67108864,71\nremap,268435456,73\n\
        copy-in,2097152,8.4\ncopy-in,67108864,53\ncopy-in,268435456,185\n";

    #[test]
    fn the_crossover_lies_between_the_sizes_where_the_order_flips() {
        let table = Table::parse("bind-cost.csv", BIND, &["method", "bytes", "microseconds"])
            .expect("parses");
        let series = bind_series(&table).expect("numbers");
        let at = crossover(&series["remap"], &series["copy-in"]).expect("they cross");
        assert!(at > 64.0 && at < 256.0, "{at} MiB");
        // Interpolated in log-log: 64 MiB × 4^(0.292 / 1.222), about 89 MiB.
        assert!((at - 89.2).abs() < 0.5, "{at} MiB");
        assert_eq!(crossover(&series["remap"], &series["remap"]), None);
    }

    #[test]
    fn bad_files_are_refused_with_the_reason() {
        let header = ["method", "bytes", "microseconds"];
        let no_device = "method,bytes,microseconds\nremap,1,2\n";
        assert!(Table::parse("x", no_device, &header)
            .unwrap_err()
            .contains("device"));
        let wrong_header = "# device: G\nmethod,size,us\nremap,1,2\n";
        assert!(Table::parse("x", wrong_header, &header)
            .unwrap_err()
            .contains("header"));
        let short_row = "# device: G\nmethod,bytes,microseconds\nremap,1\n";
        assert!(Table::parse("x", short_row, &header)
            .unwrap_err()
            .contains("2 cells"));
        let negative = "# device: G\nmethod,bytes,microseconds\nremap,1,-2\n";
        let table = Table::parse("x", negative, &header).expect("parses");
        assert!(bind_series(&table).unwrap_err().contains("positive"));
    }

    #[test]
    fn the_committed_results_draw_and_name_their_device() {
        let results = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/results");
        let out = std::env::temp_dir().join(format!("stablebuf-plots-{}", std::process::id()));
        run(&results, &out).expect("the committed results draw");
        for name in ["bind-cost.svg", "decode-step.svg", "pause-resume.svg"] {
            let svg = std::fs::read_to_string(out.join(name)).expect("written");
            assert!(svg.contains("H100"), "{name} does not name the device");
        }
        let bind = std::fs::read_to_string(out.join("bind-cost.svg")).expect("written");
        assert!(bind.contains("crossover"), "the crossover is not marked");
        let _ = std::fs::remove_dir_all(&out);
    }
}
