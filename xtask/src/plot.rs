//! `cargo xtask plot`: the benchmark figure of `docs/BENCHMARKS.md`, drawn
//! with plotters from a points file (medians already taken by
//! `bench_vs_mlxlm.py`, each point naming its source run).
//!
//! Two log-log panels: prefill tok/s against prompt length, and decode
//! tok/s against the context it decodes after; mlex solid, mlx-lm dashed,
//! one colour per model.

use crate::workspace_root;
use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use plotters::style::FontStyle;
use serde::Deserialize;
use std::path::PathBuf;

#[derive(Deserialize)]
struct Points {
    title: String,
    prefill: Vec<Series>,
    decode: Vec<Series>,
}

#[derive(Deserialize)]
struct Series {
    series: String,
    /// `[x, y, source]`.
    points: Vec<(f64, f64, String)>,
}

/// Fonts plotters can draw with: its pure-Rust `ab_glyph` renderer needs a
/// TrueType file; Debian's `fonts-dejavu-core` has one.
fn register_font() -> Result<()> {
    let candidates = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
        "/System/Library/Fonts/Supplemental/Arial.ttf",
    ];
    let path = candidates
        .iter()
        .find(|p| std::path::Path::new(p).exists())
        .context("no TrueType font found (apt-get install fonts-dejavu-core)")?;
    let bytes: &'static [u8] = Box::leak(std::fs::read(path)?.into_boxed_slice());
    if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_err() {
        bail!("{path} is not a usable TrueType font");
    }
    Ok(())
}

/// Draws `DATA` (default `docs/data/h200-2026-12-01-points.json`) into
/// `PNG` (default `docs/bench-h200.png`).
pub fn plot(args: &[String]) -> Result<()> {
    let root = workspace_root();
    let data = args
        .first()
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("docs/data/h200-2026-12-01-points.json"));
    let out = args
        .get(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("docs/bench-h200.png"));
    let text = std::fs::read_to_string(&data).with_context(|| format!("{}", data.display()))?;
    let points: Points = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a points file", data.display()))?;
    register_font()?;
    let area = BitMapBackend::new(&out, (1400, 620)).into_drawing_area();
    area.fill(&WHITE)?;
    let (title, body) = area.split_vertically(40);
    title.titled(&points.title, ("sans-serif", 20))?;
    let panels = body.split_evenly((1, 2));
    draw(
        &panels[0],
        "prefill tok/s vs prompt length",
        "prompt tokens",
        &points.prefill,
    )?;
    draw(
        &panels[1],
        "decode tok/s vs context length",
        "context tokens",
        &points.decode,
    )?;
    area.present()?;
    eprintln!("xtask: wrote {}", out.display());
    Ok(())
}

fn colour(name: &str) -> RGBColor {
    if name.contains("Qwen3.5") {
        RGBColor(200, 60, 40)
    } else if name.contains("Nemotron") {
        RGBColor(40, 130, 60)
    } else {
        RGBColor(40, 80, 200)
    }
}

fn draw(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    caption: &str,
    x_label: &str,
    series: &[Series],
) -> Result<()> {
    let all = || series.iter().flat_map(|s| s.points.iter());
    let (ymin, ymax) = all().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    if series.is_empty() || ymin <= 0.0 {
        bail!("{caption}: no positive points to draw");
    }
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (100f64..20_000f64).log_scale(),
            ((ymin * 0.6)..(ymax * 1.6)).log_scale(),
        )?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc("tok/s")
        .label_style(("sans-serif", 13))
        .draw()?;
    for s in series {
        let c = colour(&s.series);
        let ours = s.series.starts_with("mlex");
        let xy: Vec<(f64, f64)> = s.points.iter().map(|p| (p.0, p.1)).collect();
        let style = ShapeStyle::from(&c).stroke_width(if ours { 3 } else { 2 });
        let drawn = if ours {
            chart.draw_series(LineSeries::new(xy.clone(), style))?
        } else {
            chart.draw_series(DashedLineSeries::new(xy.clone(), 8, 6, style))?
        };
        drawn
            .label(&s.series)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3)));
        chart.draw_series(xy.iter().map(|&p| Circle::new(p, 4, c.filled())))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    Ok(())
}
