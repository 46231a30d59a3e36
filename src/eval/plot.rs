//! PNG plots drawn with `plotters` (bitmap backend, no system font library): text is
//! rendered by `ab_glyph` from an embedded font, DejaVu Sans Mono (Bitstream Vera
//! licence, `assets/fonts/`, 343 KB). Files are drawn into a temporary sibling and
//! renamed into place.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;

use super::output::{commit, temp_sibling};
use crate::{Error, Result};

const FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSansMono.ttf");
const FAMILY: &str = "sans-serif";

fn font_ready() -> Result<()> {
    static DONE: OnceLock<bool> = OnceLock::new();
    let ok = *DONE.get_or_init(|| plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        Err(Error::Setting("plot: the embedded font could not be loaded".into()))
    }
}

fn plot_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Setting(format!("{}: cannot draw the plot: {e}", path.display()))
}

/// Colours of the lines, one per series (repeating).
const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// A line per series of `(x, y)` points, written to `path` (PNG), drawn to read at a glance:
/// x on a log2 axis with ticks at the given x values only, labelled by
/// [`crate::limits::tokens_label`] (2K, 64K, 1M);
/// y on a log10 axis when the values span more than a decade (a good and a bad model
/// both visible), else linear; the legend in a panel right of the data (never over the last
/// points), each series named by [`short_name`]; the title wrapped to the image width.
pub fn lines(path: &Path, title: &str, x_desc: &str, y_desc: &str, series: &[(String, Vec<(f64, f64)>)]) -> Result<()> {
    font_ready()?;
    let pts: Vec<(f64, f64)> = series.iter().flat_map(|s| s.1.iter().copied()).filter(|p| p.0 > 0.0 && p.1.is_finite()).collect();
    if pts.is_empty() {
        return Err(Error::Setting(format!("{}: nothing to plot (no finite value)", path.display())));
    }
    let lx = |x: f64| x.log2();
    let (x0, x1) = pts.iter().fold((f64::MAX, f64::MIN), |a, p| (a.0.min(lx(p.0)), a.1.max(lx(p.0))));
    let (x0, x1) = if x1 - x0 < 1e-9 { (x0 - 0.5, x1 + 0.5) } else { (x0, x1) };
    let (ymin, ymax) = pts.iter().fold((f64::MAX, f64::MIN), |a, p| (a.0.min(p.1), a.1.max(p.1)));
    let log_y = ymin > 0.0 && ymax / ymin > 10.0;
    let ty = |y: f64| if log_y { y.log10() } else { y };
    let (y0, y1) = (ty(ymin), ty(ymax));
    let pad = ((y1 - y0) * 0.08).max(1e-3 * y1.abs().max(1.0));
    let (y0, y1) = (y0 - pad, y1 + pad);
    let mut ticks: Vec<f64> = pts.iter().map(|p| p.0).collect();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    let names: Vec<String> = series.iter().map(|(n, _)| short_name(n)).collect();
    let title_lines = wrap(title, 70);
    let top = 18 + 26 * title_lines.len() as u32;
    png(path, (1000, 560 + 26 * (title_lines.len() as u32 - 1)), |root| {
        let root = root.clone();
        for (i, l) in title_lines.iter().enumerate() {
            root.draw(&Text::new(l.clone(), (24, 10 + 26 * i as i32), (FAMILY, 22).into_font()))?;
        }
        let (body_w, _) = root.dim_in_pixel();
        let (area, legend) = root.margin(top, 0, 0, 0).split_horizontally(body_w.saturating_sub(250));
        let mut chart = ChartBuilder::on(&area)
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(96)
            .build_cartesian_2d(x0 - 0.15..x1 + 0.15, y0..y1)?;
        // x: no automatic labels; a grid line and a label at each given length below.
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .x_desc(x_desc)
            .y_desc(if log_y { format!("{y_desc} (log scale)") } else { y_desc.to_string() })
            .y_label_formatter(&|y| {
                let v = if log_y { 10f64.powf(*y) } else { *y };
                match v.abs() {
                    a if a >= 100.0 => format!("{v:.0}"),
                    a if a >= 10.0 => format!("{v:.1}"),
                    _ => format!("{v:.3}"),
                }
            })
            .label_style((FAMILY, 14))
            .draw()?;
        for &t in &ticks {
            chart.draw_series(LineSeries::new(vec![(lx(t), y0), (lx(t), y1)], RGBColor(225, 225, 225)))?;
            // backend_coord is in the image's pixels; `area` draws relative to its corner.
            let ((px, py), (bx, by)) = (chart.backend_coord(&(lx(t), y0)), area.get_base_pixel());
            let (px, py) = (px - bx, py - by);
            let label = crate::limits::tokens_label(t.round() as usize);
            let w = 8 * label.chars().count() as i32;
            area.draw(&Text::new(label, (px - w / 2, py + 6), (FAMILY, 14).into_font()))?;
        }
        for (i, (_, s)) in series.iter().enumerate() {
            let c = PALETTE[i % PALETTE.len()];
            let line: Vec<(f64, f64)> = s.iter().filter(|p| p.0 > 0.0 && p.1.is_finite()).map(|p| (lx(p.0), ty(p.1))).collect();
            chart.draw_series(LineSeries::new(line.clone(), c.stroke_width(2)))?;
            chart.draw_series(line.into_iter().map(|p| Circle::new(p, 4, c.filled())))?;
        }
        for (i, name) in names.iter().enumerate() {
            let c = PALETTE[i % PALETTE.len()];
            let y = 40 + 28 * i as i32;
            legend.draw(&PathElement::new(vec![(8, y), (30, y)], c.stroke_width(3)))?;
            for (j, part) in wrap(name, 24).iter().enumerate() {
                legend.draw(&Text::new(part.clone(), (38, y - 8 + 16 * j as i32), (FAMILY, 14).into_font()))?;
            }
        }
        Ok(())
    })
}

/// A model named by the last two parts of its path (`runs/SmolLM2-64K/export` →
/// `SmolLM2-64K/export`); hub ids and `builtin:` names as they are.
pub fn short_name(name: &str) -> String {
    let parts: Vec<&str> = name.trim_end_matches('/').rsplit('/').take(2).collect();
    if parts.len() < 2 || name.contains(':') {
        return name.to_string();
    }
    format!("{}/{}", parts[1], parts[0])
}

/// `text` cut into lines of at most `width` characters at spaces (a longer word alone).
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for word in text.split(' ') {
        match out.last_mut() {
            Some(l) if l.chars().count() + 1 + word.chars().count() <= width => {
                l.push(' ');
                l.push_str(word);
            }
            _ => out.push(word.to_string()),
        }
    }
    if out.is_empty() {
        out.push(String::new());
    }
    out
}

/// A PNG of `size` pixels drawn by `draw` on a white page, written atomically to `path`
/// (nothing is left behind when drawing fails).
fn png(
    path: &Path,
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>) -> std::result::Result<(), Box<dyn std::error::Error>>,
) -> Result<()> {
    let tmp = temp_sibling(path);
    let res = (|| -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(&tmp, size).into_drawing_area();
        root.fill(&WHITE)?;
        draw(&root)?;
        root.present()?;
        Ok(())
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(plot_err(path, e));
    }
    commit(&tmp, path)
}

/// Red (0) → yellow (0.5) → green (1): the colour of a heatmap cell and of its colour bar.
pub fn score_colour(v: f64) -> RGBColor {
    let v = v.clamp(0.0, 1.0);
    let lerp = |a: f64, b: f64, t: f64| (a + (b - a) * t).round() as u8;
    if v < 0.5 {
        let t = v / 0.5;
        RGBColor(lerp(215.0, 250.0, t), lerp(48.0, 220.0, t), lerp(39.0, 80.0, t))
    } else {
        let t = (v - 0.5) / 0.5;
        RGBColor(lerp(250.0, 26.0, t), lerp(220.0, 150.0, t), lerp(80.0, 65.0, t))
    }
}

/// The colour of the trained-context line of a heatmap.
pub const CONTEXT_MARK: RGBColor = RGBColor(20, 60, 200);

/// What a heatmap shows: `values[r][c]` in [0, 1] (row `r`, column `c`), each cell coloured
/// and labelled with its value in percent; `None` cells are grey.
#[derive(Debug, Clone)]
pub struct Heatmap<'a> {
    pub title: &'a str,
    /// Column labels, left to right (the context lengths).
    pub lengths: &'a [usize],
    /// Row labels, top to bottom (depths such as `25%`, or task names).
    pub rows: Vec<String>,
    /// The rows' axis name (`depth`, `task`).
    pub row_desc: &'a str,
    pub values: &'a [Vec<Option<f64>>],
    /// Trials behind every cell, said in the title.
    pub trials: usize,
    /// The model's trained context: a vertical line after the last column of at most that
    /// length (the columns left of it are within the context), labelled below the axis.
    pub trained_context: Option<usize>,
}

/// Where a heatmap's parts lie, in pixels of the image (for drawing and for tests that
/// read the PNG back).
#[derive(Debug, Clone, PartialEq)]
pub struct HeatmapLayout {
    pub width: u32,
    pub height: u32,
    pub title_lines: Vec<String>,
    /// Top-left corner of the grid, and a cell's width and height.
    pub grid: (i32, i32),
    pub cell: (i32, i32),
    /// The colour bar `[x0, y0, x1, y1)`: 100 % at the top row, 0 % at the bottom row.
    pub bar: [i32; 4],
}

/// Heatmap geometry for `nx` columns and `ny` rows under `title` (wrapped to the width).
pub fn heatmap_layout(title: &str, nx: usize, ny: usize) -> HeatmapLayout {
    let (left, right, bottom) = (110i32, 150i32, 104i32);
    let cw = (760 / nx.max(1) as i32).clamp(40, 140);
    let ch = (440 / ny.max(1) as i32).clamp(24, 80).max(160 / ny.max(1) as i32);
    let width = ((left + cw * nx as i32 + right) as u32).max(480);
    // DejaVu Sans Mono at 20 px advances about 10.3 px a character.
    let title_lines = wrap(title, ((width as usize).saturating_sub(24) / 11).max(20));
    let top = 16 + 26 * title_lines.len() as i32 + 14;
    let height = (top + ch * ny as i32 + bottom) as u32;
    let bx = left + cw * nx as i32 + 36;
    HeatmapLayout { width, height, title_lines, grid: (left, top), cell: (cw, ch), bar: [bx, top, bx + 22, top + ch * ny as i32] }
}

/// The x pixel of the trained-context line: the right edge of the last column whose
/// length is at most `ctx` (the grid's left edge when every length is beyond it).
pub fn context_mark_x(layout: &HeatmapLayout, lengths: &[usize], ctx: usize) -> i32 {
    let within = lengths.iter().take_while(|&&l| l <= ctx).count() as i32;
    layout.grid.0 + within * layout.cell.0
}

/// A heatmap PNG (see [`Heatmap`]): the cells with their percent, a colour bar with its
/// scale (0–100 %) right of the grid, the trials per cell in the title and the trained
/// context marked on the length axis; laid out by [`heatmap_layout`].
pub fn heatmap(path: &Path, h: &Heatmap<'_>) -> Result<()> {
    font_ready()?;
    let (nx, ny) = (h.lengths.len(), h.rows.len());
    if nx == 0 || ny == 0 || h.values.len() != ny || h.values.iter().any(|r| r.len() != nx) {
        return Err(Error::Setting(format!("{}: heatmap needs {ny} rows of {nx} values", path.display())));
    }
    let trials = if h.trials == 1 { "1 trial per cell".to_string() } else { format!("{} trials per cell", h.trials) };
    let title = format!("{} ({trials})", h.title);
    let lay = heatmap_layout(&title, nx, ny);
    let ((left, top), (cw, ch)) = (lay.grid, lay.cell);
    let grid_bottom = top + ch * ny as i32;
    png(path, (lay.width, lay.height), |root| {
        let root = root.clone();
        let anchored = |s: String, x: i32, y: i32, size: i32, h: plotters::style::text_anchor::HPos| {
            let style = TextStyle::from((FAMILY, size).into_font())
                .pos(plotters::style::text_anchor::Pos::new(h, plotters::style::text_anchor::VPos::Center));
            Text::new(s, (x, y), style)
        };
        let centred = |s: String, x: i32, y: i32, size: i32| anchored(s, x, y, size, plotters::style::text_anchor::HPos::Center);
        for (i, l) in lay.title_lines.iter().enumerate() {
            root.draw(&Text::new(l.clone(), (12, 16 + 26 * i as i32), (FAMILY, 20).into_font()))?;
        }
        for (r, row) in h.values.iter().enumerate() {
            for (c, v) in row.iter().enumerate() {
                let (x, y) = (left + c as i32 * cw, top + r as i32 * ch);
                let fill = v.map(score_colour).unwrap_or(RGBColor(200, 200, 200));
                root.draw(&Rectangle::new([(x, y), (x + cw, y + ch)], fill.filled()))?;
                root.draw(&Rectangle::new([(x, y), (x + cw, y + ch)], WHITE.stroke_width(1)))?;
                let label = v.map(|v| format!("{:.0}", v * 100.0)).unwrap_or_else(|| "-".into());
                root.draw(&centred(label, x + cw / 2, y + ch / 2, 14))?;
            }
        }
        for (c, len) in h.lengths.iter().enumerate() {
            root.draw(&centred(crate::limits::tokens_label(*len), left + c as i32 * cw + cw / 2, grid_bottom + 14, 13))?;
        }
        root.draw(&centred("context length (tokens)".into(), left + (nx as i32 * cw) / 2, grid_bottom + 38, 15))?;
        for (r, label) in h.rows.iter().enumerate() {
            root.draw(&anchored(label.clone(), left - 8, top + r as i32 * ch + ch / 2, 13, plotters::style::text_anchor::HPos::Right))?;
        }
        root.draw(&centred(h.row_desc.to_string(), left / 2 - 16, top - 12, 15))?;
        // The colour bar, 100 % at the top, with its scale.
        let [bx0, by0, bx1, by1] = lay.bar;
        for y in by0..by1 {
            let v = 1.0 - (y - by0) as f64 / ((by1 - by0 - 1).max(1)) as f64;
            root.draw(&Rectangle::new([(bx0, y), (bx1, y + 1)], score_colour(v).filled()))?;
        }
        root.draw(&Rectangle::new([(bx0 - 1, by0 - 1), (bx1, by1)], BLACK.stroke_width(1)))?;
        for (v, label) in [(1.0, "100 %"), (0.5, "50 %"), (0.0, "0 %")] {
            let y = by0 + ((1.0 - v) * (by1 - by0 - 1) as f64).round() as i32;
            root.draw(&PathElement::new(vec![(bx1, y), (bx1 + 5, y)], BLACK.stroke_width(1)))?;
            root.draw(&anchored(label.into(), bx1 + 8, y, 13, plotters::style::text_anchor::HPos::Left))?;
        }
        root.draw(&centred("% right".into(), (bx0 + bx1) / 2, by0 - 18, 13))?;
        if let Some(ctx) = h.trained_context {
            let x = context_mark_x(&lay, h.lengths, ctx);
            root.draw(&Rectangle::new([(x - 1, top - 6), (x + 2, grid_bottom + 26)], CONTEXT_MARK.filled()))?;
            let text = format!("trained context {}", crate::limits::tokens_label(ctx));
            let anchor =
                if x > lay.width as i32 / 2 { plotters::style::text_anchor::HPos::Right } else { plotters::style::text_anchor::HPos::Left };
            let tx = if x > lay.width as i32 / 2 { x - 6 } else { x + 6 };
            let style = TextStyle::from((FAMILY, 13).into_font())
                .color(&CONTEXT_MARK)
                .pos(plotters::style::text_anchor::Pos::new(anchor, plotters::style::text_anchor::VPos::Center));
            root.draw(&Text::new(text, (tx, grid_bottom + 64), style))?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod line_tests {
    use super::*;

    #[test]
    fn labels_names_and_wrapping() {
        // Ticks are labelled by the one printer of lengths.
        assert_eq!(crate::limits::tokens_label(2048), "2K");
        assert_eq!(crate::limits::tokens_label(65536), "64K");
        assert_eq!(crate::limits::tokens_label(1048576), "1M");
        assert_eq!(crate::limits::tokens_label(1000), "1000");
        assert_eq!(short_name("runs/SmolLM2-135M-64K/export"), "SmolLM2-135M-64K/export");
        assert_eq!(short_name("/data/models/SmolLM2-135M-Instruct/"), "models/SmolLM2-135M-Instruct");
        assert_eq!(short_name("builtin:tiny"), "builtin:tiny");
        assert_eq!(short_name("export"), "export");
        assert_eq!(wrap("a bb ccc", 4), vec!["a bb", "ccc"]);
        let long = "Perplexity vs context length (data/longdocs/eval.jsonl, held-out documentation)";
        assert!(wrap(long, 70).iter().all(|l| l.chars().count() <= 70));
    }

    #[test]
    fn a_plot_of_two_models_a_thousand_times_apart_is_drawn() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ppl.png");
        let s = vec![
            ("models/base".to_string(), vec![(2048.0, 9.0), (8192.0, 7.5), (65536.0, 2316.0)]),
            ("runs/x/export".to_string(), vec![(2048.0, 9.2), (8192.0, 7.4), (65536.0, 6.6)]),
        ];
        lines(&p, "Perplexity vs context length of a title long enough to need wrapping at the image width", "length", "ppl", &s).unwrap();
        assert!(std::fs::metadata(&p).unwrap().len() > 1000);
    }
}
