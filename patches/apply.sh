#!/usr/bin/env bash
# Add `import megatron_rrfp; megatron_rrfp.install()` to a Megatron-LM checkout's
# pretrain_gpt.py and pretrain_vlm.py, and from 0.18 on also pretrain_hybrid.py (the only
# change the patches make).
#
#   patches/apply.sh CHECKOUT
#
# Not needed to use megatron-rrfp: `python -m megatron_rrfp.launch pretrain_gpt.py ...`
# runs the unmodified scripts. This is for those who prefer editing their checkout.
#
# The release is read from CHECKOUT/megatron/core/package_info.py; every release the
# README names has a patch, checked with `git apply --check` against Megatron-LM's tags
# and release branches: core_v0.15.0-core_v0.15.3 and core_r0.15.0 (0.15.4) take the
# 0.15.0 patch; core_v0.16.0, core_v0.16.1, core_r0.16.0 (0.16.2), core_v0.17.0 (0.17.0rc0
# in its package_info), core_v0.17.1 and core_r0.17.0 (0.17.2) the 0.16.1 patch;
# core_v0.18.0, core_v0.18.2, core_r0.18.0 (0.18.3), core_v0.19.0 (whose package_info says
# 0.19.1; its parent commit says 0.19.0) and core_r0.19.0 (0.19.1) the 0.19.0 patch.
#
# Success means the line is in both files afterwards: it is looked for, not inferred from
# git's exit status (inside another repository, git apply silently skips paths it
# considers outside its directory).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
line='import megatron_rrfp; megatron_rrfp.install()'

die() { echo "apply.sh: $*" >&2; exit 1; }

[[ $# -eq 1 ]] || die "usage: patches/apply.sh CHECKOUT   (a Megatron-LM source checkout)"
[[ -d "$1" ]] || die "$1 is not a directory"
checkout="$(cd "$1" && pwd -P)"
info="$checkout/megatron/core/package_info.py"
[[ -f "$info" ]] || die "$checkout is not a Megatron-LM checkout: $info not found"

field() { sed -n "s/^$1 *= *\([0-9][0-9]*\).*/\1/p" "$info" | head -n 1; }
release="$(field MAJOR).$(field MINOR).$(field PATCH)"
[[ "$release" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "could not read the release from $info (got '$release')"

# major.minor -> patch; the entry scripts' opening lines changed at 0.16 and at 0.18, where
# pretrain_hybrid.py (HybridModel) appeared.
case "${release%.*}" in
    0.15)      patch="megatron-lm-core_v0.15.0.patch"; files=(pretrain_gpt.py pretrain_vlm.py) ;;
    0.16|0.17) patch="megatron-lm-core_v0.16.1.patch"; files=(pretrain_gpt.py pretrain_vlm.py) ;;
    0.18|0.19) patch="megatron-lm-core_v0.19.0.patch"; files=(pretrain_gpt.py pretrain_hybrid.py pretrain_vlm.py) ;;
    *) die "Megatron-LM release $release is not supported (0.15.x - 0.19.x);" \
           "use 'python -m megatron_rrfp.launch SCRIPT ...', which needs no edit" ;;
esac
for file in "${files[@]}"; do
    [[ -f "$checkout/$file" ]] || die "$checkout has no $file (a megatron-core wheel or a partial checkout?);" \
        "use 'python -m megatron_rrfp.launch SCRIPT ...' instead"
done

has_line() { grep -qxF "$line" "$checkout/$1"; }
present=0
for file in "${files[@]}"; do
    if has_line "$file"; then present=$((present + 1)); fi
done
if [[ $present -eq ${#files[@]} ]]; then
    echo "apply.sh: $checkout (release $release) already has the line in ${files[*]}; nothing to do"
    exit 0
fi
[[ $present -eq 0 ]] || die "$checkout has the line in only some of ${files[*]} (edited by hand?);" \
    "revert those files and run apply.sh again. Nothing was changed."

# Patch the checkout's files as plain files: never let git find a repository around the
# checkout (a vendored copy inside another project), which would make it skip them.
cd "$checkout"
GIT_CEILING_DIRECTORIES="$(dirname "$checkout")"
export GIT_CEILING_DIRECTORIES
if ! git apply --check "$here/$patch" 2>/dev/null; then
    die "$patch does not apply to $checkout (release $release): ${files[*]}" \
        "differ from the released files (local edits?). Nothing was changed."
fi
git apply "$here/$patch"
for file in "${files[@]}"; do
    has_line "$file" || die "git apply reported success but $checkout/$file lacks '$line';" \
        "add it by hand after the first imports, or use 'python -m megatron_rrfp.launch'"
done
echo "apply.sh: applied $patch to $checkout (release $release): ${files[*]}"
