#!/bin/sh
# prune_history.sh REPO BASE_COMMIT: leave REPO holding nothing the agent must not see, and check it.
#
# Kept: the commits reachable from HEAD, which must be BASE_COMMIT or a descendant that changes no file (an image
# builder's empty commit); the branch HEAD is on; tags on commits HEAD reaches (setuptools_scm and friends derive the
# package's version from them). Removed: every other branch and tag, remotes and their refs, notes, stashes,
# replace refs, reflogs, FETCH_HEAD/ORIG_HEAD, alternates, and every object no kept ref reaches. Then checked: each
# commit object in the store is reachable from HEAD. The working tree is never touched (an image's setup may have
# left changes in it). Nothing is rewritten where the check already holds, so a pruned image gains no copy of its
# objects. Exit 0: pruned and checked; 1: the repository cannot be made safe (the message says why).
# Used by the task image's layer and by the process launcher's checkout: one implementation of the rule.
set -eu
repo=$1
want=$2
cd "$repo"
git() { command git -c core.hooksPath=/dev/null -c gc.auto=0 -c maintenance.auto=false "$@"; }
fail() { echo "prune_history: $*" >&2; exit 1; }

base=$(git rev-parse -q --verify "$want^{commit}") || fail "base commit $want is not in $repo"
head=$(git rev-parse -q --verify HEAD) || fail "$repo has no HEAD"
git merge-base --is-ancestor "$base" "$head" || fail "HEAD ($head) is not the base commit or a descendant of it"
if [ "$head" != "$base" ] && ! git diff --quiet "$base" "$head" --; then
  fail "HEAD ($head) is $(git rev-list --count "$base..$head") commit(s) past the base commit and changes files"
fi
branch=$(git symbolic-ref -q HEAD || true)

extra_objects() {  # commit and tag objects in the store that HEAD does not reach (or tags of such commits)
  git rev-list "$head" | sort > .git/prune-reachable
  git cat-file --batch-all-objects --batch-check='%(objecttype) %(objectname)' \
    | awk '$1 == "commit" {print $2}' | sort | comm -23 - .git/prune-reachable
  git cat-file --batch-all-objects --batch-check='%(objecttype) %(objectname)' | awk '$1 == "tag" {print $2}' \
    | while read -r t; do
        c=$(git rev-parse -q --verify "$t^{commit}" 2>/dev/null) || { echo "$t"; continue; }
        grep -qx "$c" .git/prune-reachable || echo "$t"
      done
  rm -f .git/prune-reachable
}
extra_refs() {  # refs other than HEAD's branch and tags of commits HEAD reaches
  git for-each-ref --format='%(refname)' | while read -r ref; do
    case "$ref" in
      "$branch") ;;
      refs/tags/*)
        c=$(git rev-parse -q --verify "$ref^{commit}" 2>/dev/null) || { echo "$ref"; continue; }
        git merge-base --is-ancestor "$c" "$head" || echo "$ref" ;;
      *) echo "$ref" ;;
    esac
  done
}
leftovers() {
  extra_refs
  extra_objects
  # loose ref files for-each-ref does not list (a symref to a deleted ref, say)
  find .git/refs -type f | sed 's#^\.git/##' | grep -v -e '^refs/tags/' -e "^${branch:-refs/heads/-}\$" || true
  git remote
  [ -z "$(find .git/logs -type f -size +0c 2>/dev/null | head -n 1)" ] || echo "reflog"
  for f in FETCH_HEAD ORIG_HEAD MERGE_HEAD CHERRY_PICK_HEAD objects/info/alternates; do
    [ ! -e ".git/$f" ] || echo ".git/$f"
  done
}

if [ -n "$(leftovers | head -n 1)" ]; then
  extra_refs | while read -r ref; do git update-ref --no-deref -d "$ref"; done
  for r in $(git remote); do git remote remove "$r"; done
  if [ -e .git/objects/info/alternates ]; then  # objects borrowed from elsewhere become the repository's own
    git repack -a -d -q && rm -f .git/objects/info/alternates
  fi
  rm -f .git/FETCH_HEAD .git/ORIG_HEAD .git/MERGE_HEAD .git/CHERRY_PICK_HEAD
  git reflog expire --expire=now --expire-unreachable=now --all
  rm -rf .git/logs
  git gc -q --prune=now
fi
left=$(leftovers)
[ -z "$left" ] || fail "still reachable after pruning: $(echo "$left" | head -n 5 | tr '\n' ' ')"
