#!/usr/bin/env python3
"""A long-document corpus written by people, rebuilt offline from documentation packages.

Sources (whatever of them is installed; Debian package names in brackets):
  - the Python documentation's reStructuredText sources [python3.11-doc, or --python-docs
    DIR holding `_sources/`], cut into books the way its tables of contents are: the
    tutorial, the language reference, the HOWTOs, the FAQ, the C API, extending/embedding,
    using, distributing, each "What's New" release, and each chapter of the library
    reference (the chapter page and every page its toctree lists, in order);
  - Perl's manual pages [perl-doc] as plain text (`pod2text`), one document per page;
  - GNU Info manuals in /usr/share/info [coreutils, gettext, bash-doc, ...], one document
    per manual (split manuals joined in order).
Documents under --min-chars characters are left out.

Split, stratified by length so that both sides have long documents: the documents sorted
by length (longest first, ties by name), every --eval-every-th one from the second on is
held out for evaluation, the rest is for training. The eval set never enters training
(`train.jsonl` and `eval.jsonl` share no document); the manifest lists each document's
side.

Output (written atomically: temporary files, then renamed):
  OUT/train.jsonl, OUT/eval.jsonl   one {"text", "source"} object per line
  OUT/manifest.json                 every document: name, split, characters, tokens
                                    (with --tokenizer), the package versions used

Usage:
  python3 scripts/make_longdocs.py --out data/longdocs --tokenizer models/SmolLM2-135M-Instruct/tokenizer.json
"""
import argparse
import glob
import gzip
import json
import os
import re
import subprocess
import sys


def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


# ---------------------------------------------------------------- Python docs

def toctree(text):
    """Entries of every `.. toctree::` block of a page, in order (options and blank lines skipped)."""
    out, inside = [], False
    for line in text.splitlines():
        if re.match(r"^\s*\.\. toctree::", line):
            inside = True
            continue
        if inside:
            if line.strip() == "" or re.match(r"^\s+:", line):
                continue
            if not line.startswith((" ", "\t")):
                inside = False
                continue
            entry = line.strip()
            m = re.search(r"<([^>]+)>$", entry)  # "Title <target>"
            out.append(m.group(1) if m else entry)
    return out


def page(root, base, name):
    """Path of a toctree entry relative to the page `base` (e.g. library/index)."""
    name = name[:-4] if name.endswith(".rst") else name
    rel = name.lstrip("/") if name.startswith("/") else os.path.normpath(os.path.join(os.path.dirname(base), name))
    p = os.path.join(root, rel + ".rst.txt")
    return rel, p if os.path.isfile(p) else None


def book(root, start, seen, depth=0):
    """The page `start` and, depth first, every page its toctrees list (each page once)."""
    rel, p = page(root, "", start)
    if p is None or rel in seen:
        return []
    seen.add(rel)
    text = read(p)
    parts = [text]
    for entry in toctree(text):
        if "*" in entry:  # glob entries
            for g in sorted(glob.glob(os.path.join(root, os.path.dirname(rel), entry + ".rst.txt"))):
                sub = os.path.relpath(g, root)[: -len(".rst.txt")]
                parts += book(root, "/" + sub, seen, depth + 1)
            continue
        sub, sp = page(root, rel, entry)
        if sp is not None:
            parts += book(root, "/" + sub, seen, depth + 1)
    return parts


def python_docs(root):
    docs = []
    seen = set()
    lib = read(os.path.join(root, "library/index.rst.txt"))
    for chapter in toctree(lib):
        rel, p = page(root, "library/index", chapter)
        if p:
            docs.append((f"python/{rel}", "\n\n".join(book(root, "/" + rel, seen))))
    whats = read(os.path.join(root, "whatsnew/index.rst.txt"))
    for entry in toctree(whats):
        rel, p = page(root, "whatsnew/index", entry)
        if p and rel not in seen:
            seen.add(rel)
            docs.append((f"python/{rel}", read(p)))
    for top in ["tutorial", "reference", "howto", "faq", "c-api", "extending", "using", "distributing", "installing", "install"]:
        if os.path.isfile(os.path.join(root, top, "index.rst.txt")):
            docs.append((f"python/{top}", "\n\n".join(book(root, f"/{top}/index", seen))))
    return docs


# ---------------------------------------------------------------- Perl and Info

def perl_pods(pod_dir):
    docs = []
    for p in sorted(glob.glob(os.path.join(pod_dir, "*.pod"))):
        r = subprocess.run(["pod2text", p], capture_output=True, text=True, errors="replace")
        if r.returncode == 0:
            docs.append((f"perl/{os.path.basename(p)[:-4]}", r.stdout))
    return docs


def info_manuals(info_dir):
    manuals = {}
    for p in sorted(glob.glob(os.path.join(info_dir, "**", "*.info*.gz"), recursive=True)):
        base = os.path.basename(p)
        m = re.match(r"^(.*)\.info(?:-(\d+))?\.gz$", base)
        if not m:
            continue
        name, part = m.group(1), int(m.group(2) or 0)
        if name.startswith("python3"):  # the Python docs come from their sources above
            continue
        with gzip.open(p, "rt", encoding="utf-8", errors="replace") as f:
            manuals.setdefault(name, []).append((part, f.read()))
    # A split manual's first file is only its index of parts when parts exist.
    out = []
    for name, parts in sorted(manuals.items()):
        parts.sort()
        texts = [t for n, t in parts if n > 0] or [t for _, t in parts]
        out.append((f"info/{name}", "\n".join(texts)))
    return out


def pkg_version(pkg):
    r = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--python-docs", default=None, help="directory holding the Python docs' _sources/ (default: /usr/share/doc/python3.*/html)")
    ap.add_argument("--perl-pods", default="/usr/share/perl/*/pod")
    ap.add_argument("--info", default="/usr/share/info")
    ap.add_argument("--min-chars", type=int, default=20000, help="leave out shorter documents (default 20000, about 5K tokens)")
    ap.add_argument("--eval-every", type=int, default=4, help="hold out every N-th document by length (default 4: a quarter)")
    ap.add_argument("--tokenizer", help="tokenizer.json to count tokens with (the `tokenizers` package)")
    a = ap.parse_args()

    docs = []
    roots = [a.python_docs] if a.python_docs else sorted(glob.glob("/usr/share/doc/python3*/html"))
    roots = [os.path.join(r, "_sources") for r in roots if os.path.isfile(os.path.join(r, "_sources", "library", "index.rst.txt"))]
    if roots:
        docs += python_docs(roots[0])
    for d in sorted(glob.glob(a.perl_pods))[:1]:
        docs += perl_pods(d)
    docs += info_manuals(a.info)
    docs = [(n, t) for n, t in docs if len(t) >= a.min_chars]
    if not docs:
        sys.exit("no documents found: install python3.11-doc, perl-doc or GNU info manuals (see --help)")
    names = [n for n, _ in docs]
    if len(set(names)) != len(names):
        sys.exit("two documents share a name")

    count = None
    if a.tokenizer:
        from tokenizers import Tokenizer
        tk = Tokenizer.from_file(a.tokenizer)
        count = lambda t: len(tk.encode(t, add_special_tokens=False).ids)

    os.makedirs(a.out, exist_ok=True)
    files = {s: open(os.path.join(a.out, f".{s}.jsonl.tmp"), "w") for s in ("train", "eval")}
    manifest = []
    if a.eval_every < 2:
        sys.exit("--eval-every must be at least 2")
    docs.sort(key=lambda d: (-len(d[1]), d[0]))
    for i, (name, text) in enumerate(docs):
        split = "eval" if i % a.eval_every == 1 else "train"
        files[split].write(json.dumps({"text": text, "source": name}, ensure_ascii=False) + "\n")
        entry = {"name": name, "split": split, "chars": len(text)}
        if count:
            entry["tokens"] = count(text)
        manifest.append(entry)
    for s, f in files.items():
        f.close()
        os.replace(os.path.join(a.out, f".{s}.jsonl.tmp"), os.path.join(a.out, f"{s}.jsonl"))
    versions = {p: pkg_version(p) for p in ("python3.11-doc", "perl-doc", "coreutils", "gettext-base", "bash-doc")}
    with open(os.path.join(a.out, ".manifest.tmp"), "w") as f:
        json.dump({"packages": versions, "eval_every": a.eval_every, "documents": manifest}, f, indent=1)
    os.replace(os.path.join(a.out, ".manifest.tmp"), os.path.join(a.out, "manifest.json"))

    for s in ("train", "eval"):
        sel = [m for m in manifest if m["split"] == s]
        line = f"{s}: {len(sel)} documents, {sum(m['chars'] for m in sel):,} characters"
        if count:
            toks = sorted((m["tokens"] for m in sel), reverse=True)
            line += f", {sum(toks):,} tokens; >= 32K tokens: {sum(t >= 32768 for t in toks)}, >= 64K: {sum(t >= 65536 for t in toks)}, >= 128K: {sum(t >= 131072 for t in toks)}"
        print(line)


if __name__ == "__main__":
    main()
