"""Feature snippets for test_jinja_oracle.py: (template, context) pairs; jinja2 decides
what each must render (or that it must be refused)."""

M = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
     {"role": "assistant", "content": "A1"}, {"role": "user", "content": "U2"}]
D = {"b": 2, "a": 1, "C": 3, "list": [1, "x", None, True, 1.5], "nested": {"k": [{"type": "text", "text": "hi"}]}}

SNIPPETS = [
    # text, comments, whitespace control, trim_blocks, lstrip_blocks
    ("plain text\n", {}),
    ("a\n\n", {}),
    ("line1\r\nline2\rline3\n", {}),
    ("{# comment #}x{#- c -#}  y  {#- c #}\nz", {}),
    ("  {% if true %}\n    yes\n  {% endif %}\nafter", {}),
    ("a  {% if true %}b{% endif %}  c\n  {%- if true %} d {% endif -%}  \n e", {}),
    ("x {{- ' y ' -}} z\n{{ 'w' }}\n", {}),
    ("{% for i in [1,2] %}\n  {{ i }}\n{% endfor %}\n", {}),
    ("{%+ if true %}  kept{% endif +%}\nnext", {}),
    ("  {{ 'var' }}  \n  {% set x = 1 %}\n{{ x }}", {}),
    ("{% raw %}{{ not parsed }} {% if %}{% endraw %}!", {}),
    ("{%- raw -%}  spaced  {%- endraw -%} .", {}),
    ("\t{% if true -%}\n\tA\n\t{%- endif %}\n\tB", {}),
    # literals and printing as Python's str()
    ("{{ none }} {{ None }} {{ true }} {{ False }} {{ 1 }} {{ -3 }} {{ 1.0 }} {{ 2.50 }} {{ 1e20 }} {{ 1e-5 }}", {}),
    ("{{ 0.1 + 0.2 }} {{ 1/3 }} {{ 10/2 }} {{ 2**0.5 }} {{ 123456789.123 }} {{ 1e16 }} {{ 1e15 }}", {}),
    ("{{ [1, 'a', none, true, 1.5, [2], {'k': 'v'}] }}", {}),
    ("{{ (1,) }} {{ (1, 2) }} {{ () }} {{ {} }} {{ [] }}", {}),
    ("{{ x }}", {"x": [{"type": "text", "text": "hi"}, {"type": "image"}]}),
    ("{{ x }}", {"x": ["it's", 'say "hi"', "both ' and \"", "tab\tnl\nbs\\", "ünï €", "\x01\x7f", "\u00a0\u2028"]}),
    ("{{ d }}", {"d": D}),
    ("{{ missing }}|{{ missing is defined }}|{{ d.nope }}|{{ d['nope'] is undefined }}", {"d": D}),
    ("{{ 'a' 'b' \"c\" }} {{ '\\n\\t\\x41\\u00e9\\U0001F600\\\\' }} {{ 'it\\'s' }}", {}),
    ("{{ 0x1F }} {{ 0o17 }} {{ 0b101 }} {{ 1_000 }} {{ 1.5e3 }}", {}),
    # operators
    ("{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7.5 // 2 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 7 / 2 }}", {}),
    ("{{ 'a' ~ 1 ~ none ~ [1] }} {{ 'ab' * 3 }} {{ [1] * 2 }} {{ 3 * 'x' }} {{ [1] + [2] }} {{ 'x' + 'y' }}", {}),
    ("{{ 1 + 'a' }}", {}),
    ("{{ 1 < 2 }} {{ 'a' < 'b' }} {{ [1,2] < [1,3] }} {{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' != 'a' }} {{ 2 >= 2 }}", {}),
    ("{{ 'a' in 'cat' }} {{ 'z' not in 'cat' }} {{ 1 in [1,2] }} {{ 'a' in {'a': 1} }} {{ 3 not in [1] }}", {}),
    ("{{ not true }} {{ not 0 }} {{ 1 and 'x' }} {{ 0 or 'y' }} {{ none or [] }} {{ '' and 1 }}", {}),
    ("{{ 'yes' if x else 'no' }} {{ 'only' if false }}|{{ 1 if 0 else 2 if 0 else 3 }}", {"x": 1}),
    ("{{ -x|abs }} {{ - 2 ** 2 }} {{ (-2) ** 2 }} {{ 2 ** 3 ** 2 }}", {"x": 5}),
    ("{{ s[0] }} {{ s[-1] }} {{ s[1:3] }} {{ s[::-1] }} {{ s[::2] }} {{ s[:-2] }} {{ s[10:] }}|{{ s[99] }}", {"s": "héllo"}),
    ("{{ l[0] }} {{ l[-1] }} {{ l[1:] }} {{ l[::-1] }} {{ l[-2:] }} {{ l[5] is defined }}", {"l": [1, 2, 3, 4]}),
    ("{{ d.a }} {{ d['b'] }} {{ d.list[1] }} {{ d.nested.k[0].text }} {{ d.list.1 }}", {"d": D}),
    ("{{ x.y }}", {}),
    ("{{ none.x }}|{{ none['x'] }}|{{ 3.y }}", {}),
    # statements
    ("{% if a %}A{% elif b %}B{% else %}C{% endif %}", {"a": 0, "b": 1}),
    ("{% for m in messages %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.revindex }}/{{ loop.revindex0 }}"
     "/{{ loop.first }}/{{ loop.last }}/{{ loop.length }}:{{ m.role }} {% endfor %}", {"messages": M}),
    ("{% for m in messages if m.role != 'system' %}{{ loop.index }}{{ m.content }}{% endfor %}", {"messages": M}),
    ("{% for x in [] %}no{% else %}empty{% endfor %}{% for x in missing %}{% else %}undef{% endfor %}", {}),
    ("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", {"d": {"x": 1, "y": [2]}}),
    ("{% for k in d %}{{ k }}{% endfor %}{% for c in 'héy' %}[{{ c }}]{% endfor %}", {"d": {"x": 1, "y": 2}}),
    ("{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}"
     "{% endfor %}", {}),
    ("{% for i in range(3) %}{{ loop.previtem }}-{{ loop.nextitem }}|{{ loop.cycle('a', 'b') }} {% endfor %}", {}),
    ("{% for a in [1,2] %}{% for b in [3,4] %}{{ loop.index }}{{ a }}{{ b }} {% endfor %}{{ loop.index }}{% endfor %}", {}),
    ("{{ range(3)|list }} {{ range(1, 10, 3)|list }} {{ range(5, 0, -2)|list }} {{ range(0)|list }}", {}),
    ("{% for i in range(10**9) %}{{ i }}{% endfor %}", {}),
    ("{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{{ x }}{% endfor %}{{ x }}", {}),
    ("{% set ns = namespace(x=1, found=false) %}{% for i in [1,2] %}{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}"
     "{{ ns.found }}", {}),
    ("{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set (c, d) = [3, 4] %}{{ c }}{{ d }}", {}),
    ("{% set t = 1, 2 %}{{ t }}", {}),
    ("{% set block %}  inner {{ 1 + 1 }}\n{% endset %}[{{ block }}]{% set up | upper | trim %} low {% endset %}[{{ up }}]",
     {}),
    ("{% macro m(a, b=2, c='x') %}{{ a }}-{{ b }}-{{ c }}{% endmacro %}{{ m(1) }} {{ m(1, 3) }} {{ m(1, c='z') }} {{ m() }}",
     {}),
    ("{% macro v() %}{{ varargs }}{{ kwargs }}{% endmacro %}{{ v(1, 2, k=3) }}", {}),
    ("{% macro w(x) %}<{{ caller() }}:{{ x }}>{% endmacro %}{% call w(5) %}body{% endcall %}", {}),
    ("{% macro w() %}{{ caller(1, 2) }}{% endmacro %}{% call(a, b) w() %}{{ a + b }}{% endcall %}", {}),
    ("{% macro rec(n) %}{% if n > 0 %}{{ n }}{{ rec(n - 1) }}{% endif %}{% endmacro %}{{ rec(5) }}", {}),
    ("{% filter upper %}shout {{ 'this' }}{% endfilter %}{% filter replace('a', 'o') | title %}banana{% endfilter %}", {}),
    ("{% generation %}gen {{ 1 }}{% endgeneration %}", {}),
    # tests
    ("{{ 1 is number }}{{ true is number }}{{ 1 is integer }}{{ 1.0 is float }}{{ 'a' is string }}{{ {} is mapping }}"
     "{{ [] is iterable }}{{ 'a' is iterable }}{{ [] is sequence }}{{ none is none }}{{ true is boolean }}"
     "{{ false is false }}{{ true is true }}{{ 1 is true }}{{ x is undefined }}{{ 2 is even }}{{ 3 is odd }}"
     "{{ 9 is divisibleby 3 }}{{ 'a' is eq 'a' }}{{ 1 is ne 2 }}{{ 1 is lt 2 }}{{ 'a' is in 'abc' }}"
     "{{ 'abc' is lower }}{{ 'ABC' is upper }}{{ none is sameas none }}{{ 1 is gt(0) }}{{ x is not defined }}", {}),
    ("{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|join(',') }}", {"messages": M}),
    ("{{ messages|rejectattr('role', 'eq', 'user')|list|length }} {{ [1, 0, 2, none]|select|list }} "
     "{{ [1, 2, 3, 4]|reject('odd')|list }} {{ [1, 2, 3]|select('gt', 1)|list }}", {"messages": M}),
    # filters
    ("{{ '  x y  '|trim }}|{{ 'xxhixx'|trim('x') }}|{{ 'hello world'|upper }}|{{ 'HeLLo'|lower }}|"
     "{{ 'hello big-world (x)'|title }}|{{ 'hELLO'|capitalize }}", {}),
    ("{{ 'abc'|length }} {{ [1, 2]|count }} {{ {'a': 1}|length }} {{ missing|length }} {{ 'héllo'|length }}", {}),
    ("{{ [3, 1, 2]|first }} {{ [3, 1, 2]|last }} {{ 'abc'|first }} {{ []|first }}|{{ [1, 2]|join('-') }} "
     "{{ ['a', 1, none]|join }}", {}),
    ("{{ missing|default('d') }} {{ none|default('d') }} {{ ''|default('d', true) }} {{ 0|d('z', boolean=true) }}", {}),
    ("{{ d|items|list }} {{ d.keys()|list }} {{ d.values()|list }} {{ d.get('a') }} {{ d.get('q', 9) }} {{ d.get('q') }}",
     {"d": {"a": 1, "b": 2}}),
    ("{{ 'abc'|list }} {{ 12|string }} {{ [1]|string }} {{ '42'|int + 1 }} {{ '4.7'|int }} {{ 'x'|int }} {{ 3.9|int }} "
     "{{ '2.5'|float }} {{ 'x'|float }} {{ 1|float }} {{ '0x1A'|int(0, 16) }} {{ true|int }}", {}),
    ("{{ 'a-b-c'|replace('-', '+') }} {{ 'aaa'|replace('a', 'b', 2) }} {{ 'ab'|replace('', '.') }}", {}),
    ("{{ [3, 1, 2]|sort }} {{ [3, 1, 2]|sort(reverse=true) }} {{ ['b', 'A', 'c']|sort }} "
     "{{ ['b', 'A', 'c']|sort(case_sensitive=true) }} {{ messages|sort(attribute='role')|map(attribute='content')|list }}",
     {"messages": M}),
    ("{{ [1, 2, 1, 3]|unique|list }} {{ ['a', 'A', 'b']|unique|list }} {{ [1, 2]|reverse|list }} {{ 'abc'|reverse }}", {}),
    ("{{ d|dictsort }} {{ d|dictsort(reverse=true) }} {{ d|dictsort(by='value') }}", {"d": {"b": 1, "a": 3, "C": 2}}),
    ("{{ 'a\\nb\\n\\nc'|indent }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent(width='> ', blank=true) }}", {}),
    ("{{ '<a href=\"x\">&\\'</a>'|escape }} {{ '<b>'|e }} {{ '<i>'|safe }}", {}),
    ("{{ [1, 5, 3]|max }} {{ [1, 5, 3]|min }} {{ [1, 2, 3]|sum }} {{ messages|map(attribute='content')|map('lower')|list }}",
     {"messages": M}),
    ("{{ 2.5|round }} {{ 3.5|round }} {{ 2.567|round(2) }} {{ 2.1|round(0, 'ceil') }} {{ -3|abs }} {{ 5|round }}", {}),
    ("{{ 'one two  three'|wordcount }} {{ 'abc'|center(9) }}| {{ 'a long sentence here'|truncate(9) }} "
     "{{ [1,2,3,4,5]|batch(2)|list }}", {}),
    ("{{ '%s is %d years, %.2f%%'|format('Al', 30, 99.5) }} {{ 'x=%s' % 5 }} {{ '%s-%s' % (1, 2) }}", {}),
    ("{{ d|attr('a') }}|{{ d|attr('items') is defined }}", {"d": {"a": 1}}),
    # tojson as transformers defines it
    ("{{ d|tojson }}", {"d": D}),
    ("{{ d|tojson(indent=2) }}\n{{ d|tojson(indent=4, sort_keys=true) }}\n{{ [] |tojson(indent=2) }}{{ {}|tojson(indent=2) }}",
     {"d": D}),
    ("{{ x|tojson }} {{ x|tojson(ensure_ascii=true) }} {{ x|tojson(separators=(',', ':')) }}",
     {"x": {"s": "é 😀 \u2028 \"q\" \\ / \t \x00 \x7f <>&'", "f": 1.0, "g": 1e100, "n": None, "b": False}}),
    ("{{ 'plain'|tojson }} {{ 3|tojson }} {{ none|tojson }} {{ (1, 2)|tojson }}", {}),
    ("{{ missing|tojson }}", {}),
    # methods
    ("{{ ' a b '.strip() }}|{{ 'xax'.strip('x') }}|{{ '  a'.lstrip() }}|{{ 'a  '.rstrip() }}|{{ 'a\\n'.rstrip('\\n') }}", {}),
    ("{{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'a b c'.split(' ', 1) }} {{ 'a b c'.rsplit(' ', 1) }} "
     "{{ 'x</think>y'.split('</think>')[-1] }} {{ 'l1\\nl2\\r\\nl3'.splitlines() }}", {}),
    ("{{ 'hello'.startswith('he') }} {{ 'hello'.endswith('lo') }} {{ 'hello'.startswith(('x', 'h')) }} "
     "{{ 'Hello World'.upper() }} {{ 'Hello'.lower() }} {{ \"they're bill's\".title() }} {{ 'hello'.capitalize() }}", {}),
    ("{{ 'aXbXc'.replace('X', '-') }} {{ 'hello'.find('l') }} {{ 'hello'.rfind('l') }} {{ 'hello'.find('z') }} "
     "{{ 'banana'.count('a') }} {{ '-'.join(['a', 'b']) }} {{ '42'.isdigit() }} {{ 'ab'.isalpha() }} {{ ' '.isspace() }}",
     {}),
    ("{{ [1, 2, 3].index(2) }} {{ [1, 1].count(1) }} {{ 'a=b=c'.partition('=') }}", {}),
    ("{{ [1].append(2) }}", {}),
    ("{{ d.pop('a') }}", {"d": {"a": 1}}),
    # globals
    ("{{ raise_exception('bad role: ' ~ 'x') }}", {}),
    ("{{ strftime_now('%Y-%m-%d %d %b %Y %H:%M') }}", {}),
    ("{{ dict(a=1, b='x') }} {{ namespace(a=1).a }}", {}),
    ("{% set j = joiner(', ') %}{% for i in [1, 2, 3] %}{{ j() }}{{ i }}{% endfor %}", {}),
    # errors jinja2 refuses at parse time
    ("{% if x %}unclosed", {}),
    ("{{ x | no_such_filter }}", {}),
    ("{{ x is no_such_test }}", {}),
    ("{% endfor %}", {}),
    ("{{ 'unterminated }}", {}),
    ("{% include 'other.jinja' %}", {}),
    ("{{ 1 / 0 }}", {}),
    ("{{ undefined_fn() }}", {}),
    ("{% for a, b in [1, 2] %}{% endfor %}", {}),
    ("{{ 'a' < 1 }}", {}),
    # more edge cases
    ("{{ 1e-7 }} {{ 123456789012345678 }} {{ -0.0 }} {{ 1e300 * 1e10 }} {{ 10 / 4 }} {{ 5 // 0.5 }} {{ -5 % 0.3 }} "
     "{{ 2.675|round(2) }} {{ 1 < 2.5 }} {{ (1, 2) == [1, 2] }} {{ 'abc' * 0 }}|{{ 0.1|tojson }} {{ [1e-7, -0.0]|tojson }}",
     {}),
    ("{{ {1: 'a', 'b': none}|tojson }} {{ {1: 'a', 2.5: true, none: 1} }} {{ {'k': [1, {'x': (1, 2)}]}|tojson }}", {}),
    ("{{ '%5s|%-5s|%.3f|%d%%' % ('a', 'b', 2.5, 7) }} {{ 'x'.center(6, '*') }} {{ '  '.isspace() }} {{ ''.join(['a', 'b']) }}",
     {}),
    ("{{ [5, 4, 3, 2, 1, 0][5:1:-2] }} {{ [1, 2, 3][-10:10] }} {{ 'hello'[-3:] }} {{ [1, 2, 3][::-2] }}", {}),
    ("{% for a, b in [(1, 2), (3, 4)] %}{{ a * b }},{% endfor %}{% for x in 'aé' | list %}{{ x }}.{% endfor %}", {}),
    ("{{ d|join(',') }} {{ d|dictsort(true) }} {{ ['b', 'a']|map('upper')|list }} {{ [3, 1]|sort|first }}",
     {"d": {"b": 1, "a": 2, "B": 3}}),
    ("{{ 5 is iterable }} {{ x is string }} {{ none is mapping }} {{ {} is sequence }} {{ 1.5 is integer }}", {}),
    ("a {% if true %}b{% endif %} c\n  {# comment #}\nx\n  {%- if true %} y{% endif %}\n{{- '' -}}\n z", {}),
    ("{% if true %}\n{% endif %}\n\n{% for i in [1] %}\n  {{ i }}\n{% endfor %}\n", {}),
    ("{{ '\\u00e9' }} {{ '\u00e9' }} {{ \"a'b\" }} {{ 'a\"b' }} {{ ['a\'b\"c'] }}", {}),
    ("{% set ns = namespace(a=namespace(b=1)) %}{% set ns.c = ns.a.b + 1 %}{{ ns.c }}{{ ns.a.b }}", {}),
    ("{% macro m() %}[{{ caller() }}]{% endmacro %}{% for i in [1, 2] %}{% call m() %}{{ i }}{% endcall %}{% endfor %}", {}),
    ("{% for i in [1, 2] %}{% set x %}v{{ i }}{% endset %}{{ x }}{% endfor %}", {}),
    ("{{ [{'a': 1}, {'a': 1}, {'a': 2}]|unique(attribute='a')|list }} {{ [{'n': 'b'}, {'n': 'A'}]|sort(attribute='n') }}", {}),
    ("{{ x }}", {"x": ["\x1b", "\u00a0", "\ufeff", "\u200b", "\U0001F600", "\u0301", "\ud7ff"]}),
    ("{{ x|tojson(ensure_ascii=true) }}", {"x": ["\x1b", "\u00a0", "\U0001F600", "\u2028"]}),
    ("{% for m in messages %}{{ loop.index }}/{{ loop.length }}{% endfor %}", {"messages": [1, 2, 3]}),
    ("{% for i in range(3) if i > 0 %}{{ loop.index }}:{{ i }}/{{ loop.length }} {% else %}none{% endfor %}", {}),
    ("{{ messages[0].content }}{{ messages[0]['role'] }}{{ messages|length }}{{ (messages|first).role }}",
     {"messages": [{"role": "user", "content": "c"}]}),
    ("{%- for message in messages -%}\n  {{- message.role }}\n{% endfor -%}\n", {"messages": M}),
    ("{{ 'x' if none is none }} {{ [] or 'empty' }} {{ 'a' and 'b' }} {{ not [] }} {{ 0 == false }} {{ '' is false }}", {}),
    ("{{ (1, 2) + (3,) }} {{ [1] + [] }} {{ 'a' * 3 + 'b' }} {{ 2 * 3 ** 2 }} {{ -2 ** 2 }} {{ (2 > 1) + 1 }}", {}),
    ("{{ 'abc'.upper().lower().title() }} {{ 'a-b'.split('-')|join('+') }} {{ 'x y z'.split(none, 1) }}", {}),
    ("{{ dict(a=1) == {'a': 1} }} {{ {'a': 1}.items()|list }} {{ {'a': {'b': 2}}.a.b }}", {}),
    ("{{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 1 == 1 != 2 }} {{ 'a' in 'abc' in 'xabcx' }} {{ 3 > 2 >= 2 > 1 }} "
     "{{ 1 < 'a' < 0 if false else 'skip' }} {{ 2 < 1 < 'x' }}", {}),
    # chat-template idioms
    ("{%- for message in messages %}{%- if message['role'] == 'system' %}{{- '<<SYS>>' + message['content'] | trim "
     "+ '<</SYS>>' }}{%- elif (message['role'] == 'user') != (loop.index0 % 2 == 1) %}{{ raise_exception('order') }}"
     "{%- else %}{{ '[' ~ message.role|upper ~ '] ' ~ message.content }}{%- endif %}{%- endfor %}", {"messages": M}),
    ("{%- set ns = namespace(last=-1) %}{%- for m in messages[::-1] %}{%- set i = messages|length - 1 - loop.index0 %}"
     "{%- if ns.last == -1 and m.role == 'user' %}{%- set ns.last = i %}{%- endif %}{%- endfor %}{{ ns.last }}",
     {"messages": M}),
    ("{%- if messages[0]['content'] is string %}{{ messages[0]['content'] }}{%- else %}{%- for p in messages[0]['content']"
     " %}{{ p['text'] }}{%- endfor %}{%- endif %}",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}),
    ("{{ bos_token }}{% for m in messages %}{{ m.content }}{% if not loop.last %}{{ eos_token }}{% endif %}{% endfor %}",
     {"messages": M, "bos_token": "<s>", "eos_token": "</s>"}),
]
