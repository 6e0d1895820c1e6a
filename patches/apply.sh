#!/usr/bin/env bash
# Add `import megatron_rrfp; megatron_rrfp.install()` to a Megatron-LM checkout's
# pretrain_gpt.py and pretrain_vlm.py (the only change the patches make).
#
#   patches/apply.sh CHECKOUT
#
# Not needed to use megatron-rrfp: `python -m megatron_rrfp.launch pretrain_gpt.py ...`
# runs the unmodified scripts. This is for those who prefer editing their checkout.
#
# The release is read from CHECKOUT/megatron/core/package_info.py and must be one the
# patches were checked against (`git apply --check` on Megatron-LM's tags and release
# branches: core_v0.16.0, core_v0.16.1, core_r0.16.0 (0.16.2), core_v0.17.0,
# core_v0.17.1, core_v0.18.0, core_v0.18.2, core_v0.19.0 and core_r0.19.0 (0.19.1)).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

die() { echo "apply.sh: $*" >&2; exit 1; }

[[ $# -eq 1 ]] || die "usage: patches/apply.sh CHECKOUT   (a Megatron-LM source checkout)"
checkout="$1"
info="$checkout/megatron/core/package_info.py"
[[ -f "$info" ]] || die "$checkout is not a Megatron-LM checkout: $info not found"
[[ -f "$checkout/pretrain_gpt.py" ]] || die "$checkout has no pretrain_gpt.py (a megatron-core wheel or" \
    "a partial checkout?); use 'python -m megatron_rrfp.launch SCRIPT ...' instead"

field() { sed -n "s/^$1 *= *\([0-9][0-9]*\).*/\1/p" "$info" | head -n 1; }
release="$(field MAJOR).$(field MINOR).$(field PATCH)"
[[ "$release" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "could not read the release from $info (got '$release')"

# release -> patch; the entry scripts' opening lines changed between 0.17 and 0.18.
case "$release" in
    0.16.0|0.16.1|0.16.2|0.17.0|0.17.1) patch="megatron-lm-core_v0.16.1.patch" ;;
    0.18.0|0.18.2|0.19.1)               patch="megatron-lm-core_v0.19.0.patch" ;;
    *) die "Megatron-LM release $release is not in the supported list" \
           "(0.16.0-0.16.2, 0.17.0, 0.17.1, 0.18.0, 0.18.2, 0.19.1);" \
           "use 'python -m megatron_rrfp.launch SCRIPT ...', which needs no edit" ;;
esac

cd "$checkout"
if git apply --reverse --check "$here/$patch" 2>/dev/null; then
    echo "apply.sh: $checkout (release $release) already has $patch applied; nothing to do"
    exit 0
fi
if ! git apply --check "$here/$patch"; then
    die "$patch does not apply to $checkout (release $release): pretrain_gpt.py or pretrain_vlm.py" \
        "differ from the released files (local edits?). Nothing was changed."
fi
git apply "$here/$patch"
echo "apply.sh: applied $patch to $checkout (release $release): pretrain_gpt.py, pretrain_vlm.py"
