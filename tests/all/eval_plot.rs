//! The needle heatmap read back from its PNG: its size is the layout's, the colour bar
//! runs from the 100 % colour at its top to the 0 % colour at its bottom, the trained
//! context is a line where the layout puts it, and the cells carry their scores' colours.

use longctx::eval::plot::{context_mark_x, heatmap, heatmap_layout, score_colour, Heatmap, CONTEXT_MARK};

struct Image {
    w: u32,
    h: u32,
    rgb: Vec<u8>,
}

impl Image {
    fn read(path: &std::path::Path) -> Image {
        let dec = png::Decoder::new(std::fs::File::open(path).unwrap());
        let mut r = dec.read_info().unwrap();
        let mut buf = vec![0; r.output_buffer_size()];
        let info = r.next_frame(&mut buf).unwrap();
        assert_eq!(info.color_type, png::ColorType::Rgb, "plotters writes RGB");
        buf.truncate(info.buffer_size());
        Image { w: info.width, h: info.height, rgb: buf }
    }

    fn at(&self, x: i32, y: i32) -> (u8, u8, u8) {
        let i = 3 * (y as usize * self.w as usize + x as usize);
        (self.rgb[i], self.rgb[i + 1], self.rgb[i + 2])
    }
}

fn rgb(c: plotters::style::RGBColor) -> (u8, u8, u8) {
    (c.0, c.1, c.2)
}

fn close(a: (u8, u8, u8), b: (u8, u8, u8), tol: i32) -> bool {
    (a.0 as i32 - b.0 as i32).abs() <= tol && (a.1 as i32 - b.1 as i32).abs() <= tol && (a.2 as i32 - b.2 as i32).abs() <= tol
}

#[test]
fn the_needle_heatmap_has_a_colour_bar_its_trial_count_and_the_trained_context() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("needle.png");
    let lengths = [1024, 2048, 4096, 8192];
    // Row 0 all right, row 1 all wrong, row 2 mixed with a missing cell.
    let values = vec![vec![Some(1.0); 4], vec![Some(0.0); 4], vec![Some(0.5), Some(0.25), None, Some(0.75)]];
    let title = "needle retrieval, teacher-forced exact match (%): runs/x/export";
    let h = Heatmap {
        title,
        lengths: &lengths,
        rows: vec!["0%".into(), "50%".into(), "100%".into()],
        row_desc: "depth",
        values: &values,
        trials: 4,
        trained_context: Some(2048),
    };
    heatmap(&p, &h).unwrap();
    let img = Image::read(&p);
    let lay = heatmap_layout(&format!("{title} (4 trials per cell)"), 4, 3);
    assert_eq!((img.w, img.h), (lay.width, lay.height));
    assert!(lay.title_lines.join(" ").contains("4 trials per cell"), "{:?}", lay.title_lines);
    // The bar lies right of the grid, inside the image.
    let [bx0, by0, bx1, by1] = lay.bar;
    assert!(bx0 > lay.grid.0 + 4 * lay.cell.0 && bx1 < img.w as i32 && by1 < img.h as i32);
    let mid_x = (bx0 + bx1) / 2;
    let top = img.at(mid_x, by0 + 1);
    let bottom = img.at(mid_x, by1 - 2);
    let middle = img.at(mid_x, (by0 + by1) / 2);
    assert!(close(top, rgb(score_colour(1.0)), 8), "bar top {top:?}");
    assert!(close(bottom, rgb(score_colour(0.0)), 8), "bar bottom {bottom:?}");
    assert!(close(middle, rgb(score_colour(0.5)), 12), "bar middle {middle:?}");
    // Green at the top (high score), red at the bottom.
    assert!(top.1 > top.0 && bottom.0 > bottom.1, "{top:?} {bottom:?}");
    // Every row of the bar is a bar colour, none white: the bar is there top to bottom.
    for y in by0 + 1..by1 - 1 {
        assert_ne!(img.at(mid_x, y), (255, 255, 255), "white at bar row {y}");
    }
    // The bar's colours are not drawn outside it: left of the bar (between grid and bar) is white.
    assert_eq!(img.at(bx0 - 12, (by0 + by1) / 2), (255, 255, 255));
    // The trained context (2K): a line after the second column.
    let x = context_mark_x(&lay, &lengths, 2048);
    assert_eq!(x, lay.grid.0 + 2 * lay.cell.0);
    let (gx, gy) = lay.grid;
    let (cw, ch) = lay.cell;
    assert_eq!(img.at(x, gy + ch / 3), rgb(CONTEXT_MARK), "the trained-context line");
    assert_ne!(img.at(gx + cw / 2 + cw / 3, gy + ch / 3), rgb(CONTEXT_MARK), "no line inside the first column");
    // Cells: a corner of each (away from the centred label) has its score's colour; the missing one is grey.
    let cell = |c: i32, r: i32| img.at(gx + c * cw + 4, gy + r * ch + 4);
    assert_eq!(cell(0, 0), rgb(score_colour(1.0)));
    assert_eq!(cell(3, 1), rgb(score_colour(0.0)));
    assert_eq!(cell(1, 2), rgb(score_colour(0.25)));
    assert_eq!(cell(2, 2), (200, 200, 200));
    // Where the line falls for other contexts: before all columns, after all of them.
    assert_eq!(context_mark_x(&lay, &lengths, 512), gx);
    assert_eq!(context_mark_x(&lay, &lengths, 1 << 20), gx + 4 * cw);
    assert_eq!(context_mark_x(&lay, &lengths, 3000), gx + 2 * cw);
}

#[test]
fn a_heatmap_without_a_trained_context_draws_no_line_and_refuses_ragged_values() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("h.png");
    let lengths = [128, 256];
    let values = vec![vec![Some(1.0), Some(1.0)]];
    let h = Heatmap {
        title: "t",
        lengths: &lengths,
        rows: vec!["single".into()],
        row_desc: "task",
        values: &values,
        trials: 1,
        trained_context: None,
    };
    heatmap(&p, &h).unwrap();
    let img = Image::read(&p);
    let lay = heatmap_layout("t (1 trial per cell)", 2, 1);
    assert_eq!((img.w, img.h), (lay.width, lay.height));
    let x = context_mark_x(&lay, &lengths, 128);
    assert_ne!(img.at(x, lay.grid.1 + lay.cell.1 / 3), rgb(CONTEXT_MARK));
    let ragged = vec![vec![Some(1.0)]];
    let bad = Heatmap { values: &ragged, ..h };
    assert!(heatmap(&dir.path().join("bad.png"), &bad).is_err());
    assert!(!dir.path().join("bad.png").exists());
}
