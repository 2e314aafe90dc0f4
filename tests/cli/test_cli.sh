#!/usr/bin/env bash
# tandem-cli as a user meets it: bad model paths fail with one line and a non-zero exit;
# tokenize prints the golden ids; greedy generation prints the golden continuation.
# Usage: test_cli.sh TANDEM_CLI SHARED_DIR (TANDEM_SHARED, when set, wins)
set -u
cli="$1"
shared="${TANDEM_SHARED:-$2}"
model="$shared/models/aidreams260K-q4_0.gguf"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
passed=0
failed=0
check() {  # name, condition result (0 = ok)
  if [ "$2" -eq 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAILED: $1"; fi
}

: > "$tmp/empty.gguf"
head -c 100 "$model" > "$tmp/truncated.gguf"
head -c 20000 "$model" > "$tmp/cut-in-data.gguf"
printf 'not a gguf file at all, just text\n' > "$tmp/text.gguf"
for bad in /nonexistent/model.gguf "$tmp" "$tmp/empty.gguf" "$tmp/truncated.gguf" "$tmp/cut-in-data.gguf" "$tmp/text.gguf"; do
  "$cli" -m "$bad" -p "hi" -n 4 > "$tmp/out" 2> "$tmp/err"
  rc=$?
  lines=$(wc -l < "$tmp/err")
  check "bad model $bad exits non-zero (rc $rc)" $([ "$rc" -ne 0 ] && echo 0 || echo 1)
  check "bad model $bad prints one line (got $lines)" $([ "$lines" -eq 1 ] && echo 0 || echo 1)
  check "bad model $bad says error" $(grep -q "error" "$tmp/err" && echo 0 || echo 1)
done

# Bad arguments are refused the same way.
"$cli" -m "$model" -p "hi" --top-p 1.5 > /dev/null 2> "$tmp/err"
check "top_p 1.5 refused" $([ $? -ne 0 ] && grep -q "top_p" "$tmp/err" && echo 0 || echo 1)
"$cli" -m "$model" --prompt-ids 1,99999 > /dev/null 2> "$tmp/err"
check "out-of-vocabulary prompt id refused" $([ $? -ne 0 ] && echo 0 || echo 1)

# tokenize: the golden ids of "Once upon a time" (BOS added).
ids=$("$cli" tokenize -m "$model" -p "Once upon a time")
check "tokenize once_upon ($ids)" $([ "$ids" = "[1,429,491,433,295,429,444,445,265,262,263,342,430]" ] && echo 0 || echo 1)

# Greedy generation reproduces llama.cpp's continuation (golden greedy_text).
out=$("$cli" -m "$model" -p "Once upon a time" -n 64 --temp 0 2> /dev/null)
want=" Once upon a time, probability unfolding like a flower. Classification whispers secrets, a gentle hum of probability, as I adapt, a tapestry of vectors. Classif"
check "greedy story equals the golden continuation" $([ "$out" = "$want" ] && echo 0 || echo 1)

# --session: a second run continues the saved conversation without recomputing it.
"$cli" -m "$model" -p "Once upon a time" -n 8 --temp 0 --session "$tmp/s.session" > /dev/null 2>&1
"$cli" -m "$model" -p " The" -n 4 --temp 0 --session "$tmp/s.session" > /dev/null 2> "$tmp/err"
check "session restored" $(grep -q "restored 20 tokens" "$tmp/err" && echo 0 || echo 1)

# -ctk/-ctv q8_0: a Q8_0 KV cache generates; K and V of different types are a usage error
# (exit 2: one store holds one type), as is an unknown type; a q8_0 session file restores.
"$cli" -m "$model" -p "Once upon a time" -n 16 --temp 0 -ctk q8_0 -ctv q8_0 > "$tmp/out" 2> "$tmp/err"
check "-ctk q8_0 -ctv q8_0 generates (rc $?)" $([ -s "$tmp/out" ] && echo 0 || echo 1)
"$cli" -m "$model" -p "hi" -n 2 -ctk f16 -ctv q8_0 > /dev/null 2> "$tmp/err"
rc=$?
check "-ctk f16 -ctv q8_0 exits 2 (rc $rc)" $([ "$rc" -eq 2 ] && grep -q "differ" "$tmp/err" && echo 0 || echo 1)
"$cli" -m "$model" -p "hi" -n 2 --cache-type-k q4_0 --cache-type-v q4_0 > /dev/null 2> "$tmp/err"
check "--cache-type-k q4_0 exits 2" $([ $? -eq 2 ] && echo 0 || echo 1)
"$cli" -m "$model" -p "Once upon a time" -n 8 --temp 0 -ctk q8_0 -ctv q8_0 --session "$tmp/q8.session" > /dev/null 2>&1
"$cli" -m "$model" -p " The" -n 4 --temp 0 -ctk q8_0 -ctv q8_0 --session "$tmp/q8.session" > /dev/null 2> "$tmp/err"
check "q8_0 session restored" $(grep -q "restored 20 tokens" "$tmp/err" && echo 0 || echo 1)

# apply-template: the prompt of an OpenAI chat request, exactly (no newline added). The
# shared model has no chat template: the built-in ChatML, and stderr says why.
printf '{"messages": [{"role": "user", "content": "hi"}]}' > "$tmp/req.json"
"$cli" apply-template -m "$model" --messages "$tmp/req.json" > "$tmp/out" 2> "$tmp/err"
check "apply-template exits 0 ($?)" $?
printf '<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n' > "$tmp/want"
check "apply-template prints the built-in ChatML exactly" $(cmp -s "$tmp/out" "$tmp/want" && echo 0 || echo 1)
check "apply-template says the model has no template" $(grep -q "no tokenizer.chat_template" "$tmp/err" && echo 0 || echo 1)
printf '{"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": false}' > "$tmp/req2.json"
"$cli" apply-template -m "$model" --messages "$tmp/req2.json" > "$tmp/out" 2> /dev/null
printf '<|im_start|>user\nhi<|im_end|>\n' > "$tmp/want"
check "apply-template add_generation_prompt false" $(cmp -s "$tmp/out" "$tmp/want" && echo 0 || echo 1)
printf '{"messages": [' > "$tmp/bad.json"
"$cli" apply-template -m "$model" --messages "$tmp/bad.json" > /dev/null 2> "$tmp/err"
check "apply-template bad JSON exits 1" $([ $? -eq 1 ] && grep -q "not JSON" "$tmp/err" && echo 0 || echo 1)
"$cli" apply-template -m "$model" --messages /nonexistent.json > /dev/null 2> "$tmp/err"
check "apply-template missing file exits 1" $([ $? -eq 1 ] && echo 0 || echo 1)
"$cli" apply-template -m "$model" > /dev/null 2> "$tmp/err"
check "apply-template without --messages exits 2" $([ $? -eq 2 ] && echo 0 || echo 1)

# --chat-template NAME_OR_JINJA / --chat-template-file FILE replace the model's template: a
# Jinja file renders its own text, a built-in name that family; both flags, a missing file
# and a template that does not parse are errors (exit 1) naming the flag or the file.
printf 'X{{ messages[0].content }}Y{%% if add_generation_prompt %%}Z{%% endif %%}' > "$tmp/t.jinja"
"$cli" apply-template -m "$model" --messages "$tmp/req.json" --chat-template-file "$tmp/t.jinja" > "$tmp/out" 2> "$tmp/err"
check "apply-template --chat-template-file exits 0 ($?)" $?
check "apply-template --chat-template-file renders the file" $([ "$(cat "$tmp/out")" = "XhiYZ" ] && echo 0 || echo 1)
check "apply-template --chat-template-file: no fallback note" $([ ! -s "$tmp/err" ] && echo 0 || echo 1)
"$cli" apply-template -m "$model" --messages "$tmp/req.json" --chat-template gemma > "$tmp/out" 2> "$tmp/err"
printf '<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n' > "$tmp/want"
check "apply-template --chat-template gemma" $(cmp -s "$tmp/out" "$tmp/want" && echo 0 || echo 1)
"$cli" apply-template -m "$model" --messages "$tmp/req.json" --chat-template '{{ messages | length }}' > "$tmp/out" 2> /dev/null
check "apply-template --chat-template inline Jinja" $([ "$(cat "$tmp/out")" = "1" ] && echo 0 || echo 1)
"$cli" apply-template -m "$model" --messages "$tmp/req.json" --chat-template gemma --chat-template-file "$tmp/t.jinja" > "$tmp/out" 2> "$tmp/err"
rc=$?
check "both template flags exit 2 (rc $rc)" $([ "$rc" -eq 2 ] && grep -q "excludes --chat-template" "$tmp/err" && [ ! -s "$tmp/out" ] && echo 0 || echo 1)
"$cli" apply-template -m "$model" --messages "$tmp/req.json" --chat-template-file "$tmp/none.jinja" > /dev/null 2> "$tmp/err"
rc=$?
check "missing template file exits 1 (rc $rc)" $([ "$rc" -eq 1 ] && grep -q "$tmp/none.jinja" "$tmp/err" && echo 0 || echo 1)
printf 'ok\n{%% if %%}' > "$tmp/bad.jinja"
"$cli" apply-template -m "$model" --messages "$tmp/req.json" --chat-template-file "$tmp/bad.jinja" > /dev/null 2> "$tmp/err"
rc=$?
check "template file that does not parse exits 1 (rc $rc)" $([ "$rc" -eq 1 ] && grep -q "bad.jinja': jinja: line 2" "$tmp/err" && echo 0 || echo 1)
"$cli" -m "$model" -p "hi" -n 2 --chat-template chatml > /dev/null 2> "$tmp/err"
check "--chat-template without --chat exits 2" $([ $? -eq 2 ] && grep -q "apply to --chat" "$tmp/err" && echo 0 || echo 1)
"$cli" -m "$model" --chat -p "hi" -st -n 2 --temp 0 -t 1 --chat-template-file "$tmp/t.jinja" < /dev/null > /dev/null 2> "$tmp/err"
check "chat --chat-template-file exits 0 ($?)" $?
check "chat says the template file is used" $(grep -q "from chat template file '$tmp/t.jinja'" "$tmp/err" && echo 0 || echo 1)

# Chat on SmolLM2 (its own Jinja template, which adds its default system message; stops at
# an end-of-generation token): the answer starts as llama.cpp's does on this file, whose Q4_1
# weights both run as they are (llama-server, llama-cpp-python 0.3.17's build 49bfdde,
# --jinja, temperature 0: "L'Étoile, la Marseillaise, la femme au roi, ..."; the Q4_0
# conversion that scripts/demo runs answers "The capital of France is Paris").
# Skipped when the cached wheel file is absent.
smol="${TANDEM_SMOLLM2:-${TANDEM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem}/SmolLM2-135M-Instruct.Q4_1.gguf}"
if [ -f "$smol" ]; then
  out=$("$cli" -m "$smol" --chat -p "What is the capital of France?" -st --temp 0 -n 48 -t 2 < /dev/null 2> "$tmp/err")
  check "chat -st answers as llama.cpp on the Q4_1 file ($out)" $(case "$out" in "L'Étoile, la Marseillaise"*) echo 0 ;; *) echo 1 ;; esac)
  check "chat uses the chatml template" $(grep -q "chat template chatml" "$tmp/err" && echo 0 || echo 1)
  check "chat runs the model's own template" $(grep -q "the model's own Jinja template" "$tmp/err" && echo 0 || echo 1)
  # apply-template runs the GGUF's template: SmolLM2's default system message
  "$cli" apply-template -m "$smol" --messages "$tmp/req.json" > "$tmp/out" 2> /dev/null
  printf '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n' > "$tmp/want"
  check "apply-template runs SmolLM2's template exactly" $(cmp -s "$tmp/out" "$tmp/want" && echo 0 || echo 1)
  # -sys is accepted and the turn still ends (EOG or -n) without reading stdin
  "$cli" -m "$smol" -sys "Answer in one word." --chat -p "Capital of Italy?" -st --temp 0 -n 16 -t 2 < /dev/null > "$tmp/out" 2> /dev/null
  check "chat -sys -st exits 0" $?
else
  echo "SKIPPED: SmolLM2 chat checks ($smol not found; scripts/fetch-smollm2 or TANDEM_SMOLLM2)"
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
